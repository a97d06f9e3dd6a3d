package gdrcodec

import (
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// MarshalForTest marshals m with the gdr codec, as a client would.
func MarshalForTest(m proto.Message) ([]byte, error) {
	data, err := (&codec{name: Name, oob: true}).Marshal(m)
	if err != nil {
		return nil, err
	}
	defer data.Free()
	return data.Materialize(), nil
}

// UnmarshalForTest decodes b with the gdr codec, as a server would.
func UnmarshalForTest(b []byte, m proto.Message) error {
	return (&codec{name: Name, oob: true}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m)
}
