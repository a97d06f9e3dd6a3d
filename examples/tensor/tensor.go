// Package tensor is the example service gdrpc ships with: messages whose
// payloads (a DeviceBuffer field, a marked bytes field, repeated buffers) move
// out-of-band. The demo, gdrperf and the tests use it.
package tensor

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Fill writes the deterministic payload of Sized: byte i is (seed + i*7) mod 251.
func Fill(p []byte, seed uint32) {
	v := seed % 251
	for i := range p {
		p[i] = byte(v)
		v += 7
		if v >= 251 {
			v -= 251
		}
	}
}

// Server implements TensorService.
type Server struct {
	tensorpb.UnimplementedTensorServiceServer
	// Alloc is where Make builds its payloads. If nil, Go memory.
	Alloc devicebuf.Allocator
}

// Echo returns the tensor it received, payloads included.
func (s *Server) Echo(_ context.Context, t *tensorpb.Tensor) (*tensorpb.Tensor, error) {
	return t, nil
}

// Digest returns the checksum of what arrived.
func (s *Server) Digest(_ context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	// The request's buffers go back to their pool once read, rather than
	// when the call ends, where the server would release them anyway.
	defer gdrcodec.ReleaseAll(t)
	sum, n, err := Checksum(t, 0)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &tensorpb.Summary{Name: t.GetName(), Bytes: n, Crc32C: sum}, nil
}

// Make returns a tensor with the payload Sized asks for.
func (s *Server) Make(_ context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	return Make(s.Alloc, r)
}

// Upload checksums every tensor of the stream.
func (s *Server) Upload(st tensorpb.TensorService_UploadServer) error {
	var sum uint32
	var n uint64
	for {
		t, err := st.Recv()
		if err == io.EOF {
			return st.SendAndClose(&tensorpb.Summary{Bytes: n, Crc32C: sum})
		}
		if err != nil {
			return err
		}
		var m uint64
		sum, m, err = Checksum(t, sum)
		gdrcodec.ReleaseAll(t)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		n += m
	}
}

// Download sends 4 tensors of Sized.Size
// bytes, with seeds Seed, Seed+1, Seed+2, Seed+3.
func (s *Server) Download(r *tensorpb.Sized, st tensorpb.TensorService_DownloadServer) error {
	for i := range uint32(4) {
		t, err := Make(s.Alloc, &tensorpb.Sized{Size: r.Size, Seed: r.Seed + i, Blob: r.Blob})
		if err != nil {
			return err
		}
		if err := st.Send(t); err != nil {
			gdrcodec.ReleaseAll(t) // not sent: still this handler's to release
			return err
		}
	}
	return nil
}

// Make builds the tensor Sized asks for, its payload in memory from alloc (Go
// memory if alloc is nil; device memory is filled through a host copy).
func Make(alloc devicebuf.Allocator, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	p := make([]byte, r.Size)
	Fill(p, r.Seed)
	t := &tensorpb.Tensor{Name: fmt.Sprintf("sized-%d-%d", r.Size, r.Seed), Shape: []int64{int64(r.Size)}}
	if r.Blob {
		t.Blob = p
		return t, nil
	}
	if alloc == nil {
		b := devicebuf.HostFromBytes(p)
		t.Data = gdrcodec.New(b)
		b.Release()
		return t, nil
	}
	b, err := alloc.Alloc(len(p))
	if err != nil {
		return nil, status.Errorf(codes.ResourceExhausted, "allocate %d bytes: %v", len(p), err)
	}
	defer b.Release()
	src := devicebuf.HostFromBytes(p)
	defer src.Release()
	if err := devicebuf.Copy(b, src); err != nil {
		return nil, status.Errorf(codes.Internal, "fill payload: %v", err)
	}
	t.Data = gdrcodec.New(b)
	return t, nil
}

// Checksum extends crc with the payloads of t (data, blob, parts, in that
// order) and returns it with the byte count. Device payloads are copied to the
// host for it.
func Checksum(t *tensorpb.Tensor, crc uint32) (uint32, uint64, error) {
	var n uint64
	add := func(db *gdrv1.DeviceBuffer) error {
		if db == nil {
			return nil
		}
		p, err := Bytes(db)
		if err != nil {
			return err
		}
		crc = crc32.Update(crc, castagnoli, p)
		n += uint64(len(p))
		return nil
	}
	if err := add(t.GetData()); err != nil {
		return 0, 0, err
	}
	crc = crc32.Update(crc, castagnoli, t.GetBlob())
	n += uint64(len(t.GetBlob()))
	for _, db := range t.GetParts() {
		if err := add(db); err != nil {
			return 0, 0, err
		}
	}
	return crc, n, nil
}

// Bytes returns a host copy of a DeviceBuffer's payload (or its host memory).
func Bytes(db *gdrv1.DeviceBuffer) ([]byte, error) {
	b, ok := gdrcodec.Buffer(db)
	if !ok {
		if uint64(len(db.GetInline())) != db.GetLength() {
			return nil, errors.New("device buffer without a payload")
		}
		return db.GetInline(), nil
	}
	if hb, err := b.HostBytes(); err == nil {
		return hb, nil
	}
	p := make([]byte, b.Len())
	dst := devicebuf.HostFromBytes(p)
	defer dst.Release()
	if err := devicebuf.Copy(dst, b); err != nil {
		return nil, err
	}
	return p, nil
}

// ChecksumBytes is the checksum Digest returns for one payload p.
func ChecksumBytes(p []byte) uint32 { return crc32.Update(0, castagnoli, p) }
