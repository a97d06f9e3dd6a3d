package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// Report is everything gdrinfo prints.
type Report struct {
	GPUs      []devicebuf.GPU `json:"gpus"`
	NVMLError string          `json:"nvml_error,omitempty"`
	CUDA      CUDAReport      `json:"cuda"`
	UCX       UCXReport       `json:"ucx"`
	Paths     []Path          `json:"paths"`
}

// CUDAReport is what the CUDA driver says.
type CUDAReport struct {
	Available     bool                   `json:"available"`
	Error         string                 `json:"error,omitempty"`
	DriverVersion string                 `json:"driver_version,omitempty"`
	Devices       []devicebuf.DeviceInfo `json:"devices,omitempty"`
}

// UCXReport is what the loaded UCX says.
type UCXReport struct {
	Available   bool     `json:"available"`
	Error       string   `json:"error,omitempty"`
	Version     string   `json:"version,omitempty"`
	Transports  []string `json:"transports,omitempty"`
	MemoryTypes []string `json:"memory_types,omitempty"`
}

// Path is one gdrpc transfer path and whether this host can use it.
type Path struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	// Reason says why the path is unavailable, or what limits it.
	Reason string `json:"reason,omitempty"`
}

func main() {
	jsonOut := flag.Bool("json", false, "print one JSON object instead of text")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "gdrinfo: takes no arguments but -json (got %q)\n", flag.Args())
		os.Exit(2)
	}
	r := collect()
	var err error
	if *jsonOut {
		err = writeJSON(os.Stdout, r)
	} else {
		err = writeText(os.Stdout, r)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gdrinfo:", err)
		os.Exit(1)
	}
}

// collect gathers the report.
func collect() Report {
	var r Report
	gpus, err := devicebuf.Inventory()
	if err != nil {
		r.NVMLError = err.Error()
	}
	r.GPUs = gpus
	if r.GPUs == nil {
		r.GPUs = []devicebuf.GPU{}
	}

	cudaErr := devicebuf.CUDAAvailable()
	var cudaDevices int
	if cudaErr == nil {
		if v, err := devicebuf.DriverVersion(); err == nil {
			r.CUDA.DriverVersion = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
		}
		n, err := devicebuf.DeviceCount()
		if err != nil {
			cudaErr = err
		}
		cudaDevices = n
		for i := 0; i < n; i++ {
			info, err := devicebuf.Describe(i)
			if err != nil {
				cudaErr = fmt.Errorf("device %d: %w", i, err)
				break
			}
			r.CUDA.Devices = append(r.CUDA.Devices, info)
		}
		if cudaErr == nil && n == 0 {
			cudaErr = errors.New("the CUDA driver sees no device")
		}
	}
	r.CUDA.Available = cudaErr == nil
	if cudaErr != nil {
		r.CUDA.Error = cudaErr.Error()
	}

	var info rdma.Info
	ucxErr := rdma.Available()
	ucxCUDA := errors.New("no UCX")
	if ucxErr == nil {
		ctx, err := rdma.Default()
		if err != nil {
			ucxErr = err
		} else {
			info = ctx.Info()
			ucxCUDA = cudaThroughUCX(ctx, cudaErr)
		}
	}
	r.UCX.Available = ucxErr == nil
	if ucxErr != nil {
		r.UCX.Error = ucxErr.Error()
	} else {
		r.UCX.Version = info.Version
		r.UCX.Transports = info.Transports
		for _, m := range info.MemoryTypes {
			r.UCX.MemoryTypes = append(r.UCX.MemoryTypes, m.String())
		}
	}
	r.Paths = paths(cudaErr, cudaDevices, ucxErr, ucxCUDA, info)
	return r
}

// cudaThroughUCX returns nil when ctx registers and moves CUDA memory as
// gdrpc's sessions would use it (a CUDA-enabled UCX, the CUDA driver's
// contexts handed to it), else why not.
func cudaThroughUCX(ctx *rdma.Context, cudaErr error) error {
	if !ctx.Info().HasMemoryType(rdma.MemoryCUDA) {
		return fmt.Errorf("UCX %s cannot register CUDA memory", ctx.Info().Version)
	}
	if cudaErr != nil {
		return fmt.Errorf("no CUDA: %w", cudaErr)
	}
	t, err := devicebuf.CUDAThreadContexts()
	if err == nil {
		err = ctx.UseCUDA(t, 0)
	}
	if err != nil {
		return fmt.Errorf("UCX registers CUDA memory, but not for gdrpc: %w", err)
	}
	return nil
}

// paths decides which transfer paths this host offers, best first. ucxCUDA is
// nil when UCX moves CUDA memory itself, else why not; info is the loaded
// UCX's.
func paths(cudaErr error, cudaDevices int, ucxErr error, ucxCUDA error, info rdma.Info) []Path {
	var ps []Path
	// cuda-ipc: both ends on this host with CUDA.
	if cudaErr == nil {
		ps = append(ps, Path{Name: "cuda-ipc", Available: true,
			Reason: fmt.Sprintf("between processes on this host that trust each other (gdrpc.WithTrustPeers), %d CUDA device(s)", cudaDevices)})
	} else {
		ps = append(ps, Path{Name: "cuda-ipc", Reason: "no CUDA: " + cudaErr.Error()})
	}
	// rdma: UCX present; device memory takes part only if UCX can register it.
	// Like cuda-ipc it needs UCX sessions, which run between peers that trust
	// each other alone.
	const trusted = "between processes that trust each other (gdrpc.WithTrustPeers, or WithTransport(ModeUCX), which says as much, on both ends; other sessions run over TCP, payloads by the stream path): "
	switch {
	case ucxErr != nil:
		ps = append(ps, Path{Name: "rdma", Reason: "no UCX: " + ucxErr.Error()})
	case ucxCUDA == nil:
		ps = append(ps, Path{Name: "rdma", Available: true, Reason: trusted + "host and GPU memory: UCX registers CUDA memory and moves it itself " +
			"where a session's lane reaches GPU memory without the CPU (GPUDirect RDMA over InfiniBand/RoCE, its cuda_ipc on one host); " +
			"GPU to GPU on one device takes it (its cuda_ipc keeps its mappings), between two devices of this host cuda-ipc does, " +
			"each the faster there; " + oneHost(info) + "; " + overTCP(info)})
	default:
		ps = append(ps, Path{Name: "rdma", Available: true, Reason: trusted + "host memory only: " + ucxCUDA.Error() + "; " + oneHost(info) + "; " + overTCP(info)})
	}
	// staged: UCX and CUDA, device memory through pinned host bounce buffers.
	var missing []string
	if ucxErr != nil {
		missing = append(missing, "no UCX: "+ucxErr.Error())
	}
	if cudaErr != nil {
		missing = append(missing, "no CUDA: "+cudaErr.Error())
	}
	switch {
	case len(missing) == 0 && ucxCUDA == nil:
		ps = append(ps, Path{Name: "staged", Available: true, Reason: "GPU memory through pinned host buffers, on sessions whose UCX lanes are tcp only"})
	case len(missing) == 0:
		ps = append(ps, Path{Name: "staged", Available: true, Reason: "GPU memory through pinned host buffers over UCX"})
	default:
		ps = append(ps, Path{Name: "staged", Reason: strings.Join(missing, "; ")})
	}
	ps = append(ps, Path{Name: "stream", Available: true, Reason: fmt.Sprintf("bytes over the session's bulk lane (always); over a TCP session (peers not trusted) host payloads under %d KiB travel inline instead", gdrcodec.StreamEagerThreshold>>10)})
	return ps
}

// oneHost says how host memory moves between two processes of this host:
// UCX's rma lane there is tcp/lo, so puts into a peer's UCX shared-memory
// segment are copies of the owner's own, where UCX has a shared-memory
// transport and nothing turned direct copies off (rdma.DirectCopiesOff).
func oneHost(info rdma.Info) string {
	if off := rdma.DirectCopiesOff(); off != "" {
		return "between processes of this host, host memory goes by UCX's puts over its rma lane (tcp/lo; direct copies off: " + off + ")"
	}
	if !slices.ContainsFunc(info.Transports, sharedMemory) {
		return "between processes of this host, host memory goes by UCX's puts over its rma lane (no UCX shared-memory transport, posix or sysv, to copy into: UCX_TLS)"
	}
	return "between processes of this host, the owner copies host memory straight into the receiver's UCX shared-memory segment (UCX's own rma lane there is tcp/lo; " + rdma.DirectEnv + "=false turns this off)"
}

// sharedMemory reports whether a UCX transport (as rdma.Info lists them,
// "name/device") is one whose memory a direct copy goes into.
func sharedMemory(t string) bool {
	name, _, _ := strings.Cut(t, "/")
	return name == "posix" || name == "sysv"
}

// overTCP says what transfers between two hosts do when UCX reaches the peer
// over its tcp transport alone (no RDMA NIC).
func overTCP(info rdma.Info) string {
	if info.AtLeast(1, 18) {
		return fmt.Sprintf("between hosts over UCX's tcp alone, host memory under %[1]d MiB goes by rdma, from %[1]d MiB by the stream on the session's wide lane (TCP), and GPU memory staged (UCX %[2]s's puts over tcp beat the stream on the UCX bulk lane)", transport.WideLaneMin>>20, info.Version)
	}
	return fmt.Sprintf("between hosts over UCX's tcp alone, transfers take the stream, from %d MiB on the session's wide lane (TCP) (UCX %s's puts over tcp are slower; 1.18 and later's are not)", transport.WideLaneMin>>20, info.Version)
}

func writeJSON(w io.Writer, r Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func orderingName(v int) string {
	switch v {
	case devicebuf.WritesOrderingNone:
		return "none (flush needed)"
	case devicebuf.WritesOrderingOwner:
		return "owner"
	case devicebuf.WritesOrderingAllDevices:
		return "all devices"
	}
	return fmt.Sprint(v)
}

func flushName(v int) string {
	var parts []string
	if v&devicebuf.FlushWritesOptionHost != 0 {
		parts = append(parts, "host")
	}
	if v&devicebuf.FlushWritesOptionMemOps != 0 {
		parts = append(parts, "memops")
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

func writeText(out io.Writer, r Report) error {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }

	p("GPUs (NVML)\n")
	if r.NVMLError != "" {
		p("  unavailable: %s\n", r.NVMLError)
	} else if len(r.GPUs) == 0 {
		p("  none\n")
	}
	for _, g := range r.GPUs {
		idx := "-"
		if g.Index >= 0 {
			idx = fmt.Sprint(g.Index)
		}
		numa := "?"
		if g.NUMANode >= 0 {
			numa = fmt.Sprint(g.NUMANode)
		}
		p("  cuda %s\t%s\t%s\tpci %s\t%.1f GiB\tnuma %s\tcpus %s\n", idx, g.Name, g.UUID, g.PCIBusID,
			float64(g.MemoryBytes)/(1<<30), numa, g.CPUAffinity)
	}

	p("\nCUDA\n")
	if !r.CUDA.Available {
		p("  unavailable: %s\n", r.CUDA.Error)
	} else {
		p("  driver\t%s\n", r.CUDA.DriverVersion)
		for _, d := range r.CUDA.Devices {
			p("  device %d\t%s\t%s\tcc %s\tpci %s\n", d.Index, d.Name, d.UUID, d.ComputeCapability, d.PCIBusID)
			p("    \tGPUDirect RDMA %s\tflush options %s\twrites ordering %s\n",
				yesNo(d.Attrs.GPUDirectRDMASupported), flushName(d.Attrs.FlushWritesOptions), orderingName(d.Attrs.WritesOrdering))
		}
	}

	p("\nUCX\n")
	if !r.UCX.Available {
		p("  unavailable: %s\n", r.UCX.Error)
	} else {
		p("  version\t%s\n", r.UCX.Version)
		p("  transports\t%s\n", strings.Join(r.UCX.Transports, " "))
		p("  memory types\t%s\n", strings.Join(r.UCX.MemoryTypes, " "))
	}

	p("\nTransfer paths (best first)\n")
	for _, path := range r.Paths {
		state := "available"
		if !path.Available {
			state = "unavailable"
		}
		p("  %s\t%s\t%s\n", path.Name, state, path.Reason)
	}
	return w.Flush()
}
