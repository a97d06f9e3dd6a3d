//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
)

// TestUCXABI checks rdma/ucxabi.h against the UCX development headers: it compiles
// testdata/ucxabi with the C compiler cgo uses and runs it. The program compares every
// size, offset and constant of checks.h as ucxabi.h declares it with the value under
// <ucp/api/ucp.h>, and fails to compile when a function or callback signature of
// ucxabi_funcs.h differs from the real one. Without the headers the test skips, or fails
// when GDRPC_REQUIRE contains ucx.
func TestUCXABI(t *testing.T) {
	cc := cCompiler(t)
	cflags := ucxCFlags()
	probe := filepath.Join(t.TempDir(), "probe.c")
	require.NoError(t, os.WriteFile(probe, []byte("#include <ucp/api/ucp.h>\n"), 0o644))
	if out, err := runCC(cc, append(slices.Clone(cflags), "-fsyntax-only", probe)...); err != nil {
		testenv.Need(t, "ucx-headers", fmt.Errorf("UCX headers not found (%v): %s", err, out))
	}

	dir := filepath.Join("testdata", "ucxabi")
	bin := filepath.Join(t.TempDir(), "ucxabi")
	args := append(slices.Clone(cflags), "-std=gnu11", "-Wall", "-Werror", "-I.", "-I"+dir, "-o", bin,
		filepath.Join(dir, "ours.c"), filepath.Join(dir, "real.c"), filepath.Join(dir, "main.c"))
	out, err := runCC(cc, args...)
	require.NoError(t, err, "compile the ABI check:\n%s", out)

	out, err = exec.Command(bin).CombinedOutput()
	var failed []string
	for line := range strings.Lines(string(out)) {
		if strings.HasPrefix(line, "FAIL") {
			failed = append(failed, strings.TrimSpace(line))
		}
	}
	require.NoError(t, err, "ucxabi.h differs from the UCX headers:\n%s", strings.Join(failed, "\n"))
	t.Log(lastLine(out))
}

// TestUCXABIComplete fails when ucxabi.h declares a UCX name, or a struct member, that
// neither testdata/ucxabi/checks.h nor the signature lists of ucxabi_funcs.h check. It
// reads the files only, so it runs without the UCX headers.
func TestUCXABIComplete(t *testing.T) {
	header := readC(t, "ucxabi.h")
	checks := readC(t, filepath.Join("testdata", "ucxabi", "checks.h"))
	funcs := readC(t, "ucxabi_funcs.h")

	checked := map[string]bool{}
	for _, m := range regexp.MustCompile(`\b(?:SIZE|VSIZE|OPAQUE|CONST|ATMOST)\(`).FindAllStringIndex(checks, -1) {
		arg := balanced(checks[m[1]-1:])
		for _, id := range ucxName.FindAllString(arg, -1) {
			checked[id] = true
		}
	}
	for _, m := range regexp.MustCompile(`\bFIELD\(([^,]+),\s*([\w.]+)\)`).FindAllStringSubmatch(checks, -1) {
		checked[strings.Join(strings.Fields(m[1]), " ")+"."+m[2]] = true
		for _, id := range ucxName.FindAllString(m[0], -1) {
			checked[id] = true
		}
	}
	signed := map[string]bool{}
	for _, m := range regexp.MustCompile(`X\(\s*[^,]+,\s*(\w+)\s*,`).FindAllStringSubmatch(funcs, -1) {
		signed[m[1]] = true
	}

	var missing []string
	tags := regexp.MustCompile(`\b(?:struct|union)\s+` + ucxName.String())
	for _, id := range ucxName.FindAllString(tags.ReplaceAllString(header, ""), -1) {
		if !checked[id] && !signed[id] && !slices.Contains(missing, id) {
			missing = append(missing, id)
		}
	}
	fields := structFields(header)
	require.NotEmpty(t, fields)
	for _, f := range fields {
		if !checked[f] {
			missing = append(missing, f)
		}
	}
	require.Empty(t, missing, "declared in ucxabi.h but not checked by testdata/ucxabi/checks.h")
}

// ucxName matches a UCX identifier.
var ucxName = regexp.MustCompile(`\b(?:ucp|ucs|UCP|UCS)_\w+`)

// structFields returns "T.member" for every member of every struct or union ucxabi.h
// defines, nested ones as "T.outer.inner". T is the typedef name, or "struct tag" for a
// struct defined apart from its typedef.
func structFields(src string) []string {
	var out []string
	def := regexp.MustCompile(`(typedef\s+)?(?:struct|union)\s*(\w*)\s*\{`)
	done := 0
	for _, m := range def.FindAllStringSubmatchIndex(src, -1) {
		if m[0] < done {
			continue // nested in the previous definition: members() lists it
		}
		body := balancedBraces(src[m[1]-1:])
		done = m[1] - 1 + len(body)
		rest := src[m[1]-1+len(body):]
		name := "struct " + src[m[4]:m[5]]
		if m[2] >= 0 {
			name = strings.TrimSpace(rest[1:strings.IndexByte(rest, ';')])
		}
		out = append(out, members(name, body[1:len(body)-1])...)
	}
	return out
}

// members lists the members of one struct body, descending into nested unions and structs.
func members(prefix, body string) []string {
	var out []string
	for len(strings.TrimSpace(body)) > 0 {
		brace, semi := strings.IndexByte(body, '{'), strings.IndexByte(body, ';')
		if brace >= 0 && brace < semi {
			inner := balancedBraces(body[brace:])
			after := body[brace+len(inner):]
			end := strings.IndexByte(after, ';')
			name := strings.TrimSpace(after[:end])
			out = append(out, prefix+"."+name)
			out = append(out, members(prefix+"."+name, inner[1:len(inner)-1])...)
			body = after[end+1:]
			continue
		}
		decl := body[:semi]
		body = body[semi+1:]
		if m := regexp.MustCompile(`\(\s*\*\s*(\w+)\s*\)`).FindStringSubmatch(decl); m != nil {
			out = append(out, prefix+"."+m[1])
			continue
		}
		decl, _, _ = strings.Cut(decl, "[")
		ids := regexp.MustCompile(`\w+`).FindAllString(decl, -1)
		out = append(out, prefix+"."+ids[len(ids)-1])
	}
	return out
}

// balancedBraces returns the prefix of s, which starts with '{', up to its matching '}'.
func balancedBraces(s string) string { return matching(s, '{', '}') }

// balanced returns the prefix of s, which starts with '(', up to its matching ')'.
func balanced(s string) string { return matching(s, '(', ')') }

func matching(s string, open, close byte) string {
	depth := 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case open:
			depth++
		case close:
			depth--
			if depth == 0 {
				return s[:i+1]
			}
		}
	}
	return s
}

// readC returns a C source file without its comments and line continuations.
func readC(tb testing.TB, path string) string {
	tb.Helper()
	b, err := os.ReadFile(path)
	require.NoError(tb, err)
	s := regexp.MustCompile(`(?s)/\*.*?\*/|//[^\n]*`).ReplaceAllString(string(b), "")
	return strings.ReplaceAll(s, "\\\n", "\n")
}

// cCompiler returns the C compiler command cgo uses.
func cCompiler(tb testing.TB) []string {
	tb.Helper()
	out, err := exec.Command("go", "env", "CC").Output()
	if cc := strings.Fields(string(out)); err == nil && len(cc) > 0 {
		return cc
	}
	return []string{"cc"}
}

// ucxCFlags returns pkg-config's compiler flags for UCX, or none where pkg-config or its
// ucx entry is absent (the headers may still be on the default include path).
func ucxCFlags() []string {
	out, err := exec.Command("pkg-config", "--cflags", "ucx").Output()
	if err != nil {
		return nil
	}
	return strings.Fields(string(out))
}

func runCC(cc []string, args ...string) ([]byte, error) {
	cmd := exec.Command(cc[0], append(slices.Clone(cc[1:]), args...)...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		err = fmt.Errorf("%s: %w", cc[0], err)
	}
	return out, err
}

func lastLine(out []byte) string {
	out = bytes.TrimSpace(out)
	if i := bytes.LastIndexByte(out, '\n'); i >= 0 {
		return string(out[i+1:])
	}
	return string(out)
}
