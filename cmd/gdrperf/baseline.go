package main

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The baseline service: what a user without gdrpc runs today, a plain bytes
// field in an ordinary protobuf message. Its messages (the well-known
// wrappers) hold no device buffer, so even in a process where gdrcodec
// replaced the "proto" codec they are marshaled by gRPC's own codec. It is
// declared by hand, as protoc-gen-go-grpc would, to keep the tool free of
// generated code of its own.
const baselineService = "gdrperf.Baseline"

// Full method names of the baseline service.
const (
	// Make returns a payload of the requested size (UInt64Value -> BytesValue).
	methodMake = "/" + baselineService + "/Make"
	// Push takes a payload and answers its length, or its CRC-32C when the
	// call carries the verify header (BytesValue -> UInt64Value).
	methodPush = "/" + baselineService + "/Push"
	// MakeNaive is Make for a GPU payload the naive way: the server copies its
	// device buffer to host memory and sends the bytes.
	methodMakeNaive = "/" + baselineService + "/MakeNaive"
	// PushNaive is Push into GPU memory the naive way: the server copies the
	// received bytes into a device buffer.
	methodPushNaive = "/" + baselineService + "/PushNaive"
)

// baselineServer is what the baseline service's handlers call.
type baselineServer interface {
	Make(ctx context.Context, size *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error)
	Push(ctx context.Context, p *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error)
	MakeNaive(ctx context.Context, size *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error)
	PushNaive(ctx context.Context, p *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error)
}

func unaryHandler[Req, Resp any](method string, fn func(baselineServer, context.Context, *Req) (*Resp, error)) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
		in := new(Req)
		if err := dec(in); err != nil {
			return nil, err
		}
		s := srv.(baselineServer)
		if icpt == nil {
			return fn(s, ctx, in)
		}
		info := &grpc.UnaryServerInfo{Server: srv, FullMethod: method}
		return icpt(ctx, in, info, func(ctx context.Context, req any) (any, error) {
			return fn(s, ctx, req.(*Req))
		})
	}
}

var baselineDesc = grpc.ServiceDesc{
	ServiceName: baselineService,
	HandlerType: (*baselineServer)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Make", Handler: unaryHandler(methodMake, baselineServer.Make)},
		{MethodName: "Push", Handler: unaryHandler(methodPush, baselineServer.Push)},
		{MethodName: "MakeNaive", Handler: unaryHandler(methodMakeNaive, baselineServer.MakeNaive)},
		{MethodName: "PushNaive", Handler: unaryHandler(methodPushNaive, baselineServer.PushNaive)},
	},
	Metadata: "gdrperf/baseline",
}
