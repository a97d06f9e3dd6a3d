package gdrcodec_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

const envRegisterChild = "GDRPC_TEST_REGISTER_CHILD"

// TestConcurrentRegister runs, in a process of its own (this package's TestMain
// registers the codecs), gRPC calls concurrently with everything that used to
// write gRPC's codec registry on first use, then with later Register calls. Under
// -race the child fails on any unsynchronized access; without it, on a wrong
// status or payload.
func TestConcurrentRegister(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envRegisterChild+"=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "register child:\n%s", out)
	require.Contains(t, string(out), "register child: ok")
}

// registerChild runs the child's side when this binary was started as it.
func registerChild() {
	if os.Getenv(envRegisterChild) == "" {
		return
	}
	if err := registerScenario(); err != nil {
		fmt.Fprintln(os.Stderr, "register child:", err)
		os.Exit(2)
	}
	fmt.Println("register child: ok")
	os.Exit(0)
}

func registerScenario() error {
	ctx := context.Background()
	// A plain gRPC server and client: every call looks its codec up in gRPC's registry.
	plainLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	plainSrv := grpc.NewServer()
	tensorpb.RegisterTensorServiceServer(plainSrv, &tensor.Server{})
	go plainSrv.Serve(plainLis)
	defer plainSrv.Stop()
	plainCC, err := grpc.NewClient(plainLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer plainCC.Close()
	plain := tensorpb.NewTensorServiceClient(plainCC)

	const n = 2 * gdrcodec.StreamEagerThreshold // out-of-band with the gdr codec, over any session
	blob := pattern(n, 5)
	want := tensor.ChecksumBytes(blob)
	// A marked bytes field: inline with the proto codec, out-of-band with gdr.
	plainCall := func(c tensorpb.TensorServiceClient) error {
		sum, err := c.Digest(ctx, &tensorpb.Tensor{Blob: blob})
		if err != nil {
			return err
		}
		if sum.Crc32C != want {
			return fmt.Errorf("digest %#x, want %#x", sum.Crc32C, want)
		}
		return nil
	}
	// A DeviceBuffer each way: gdr only.
	gdrCall := func(c tensorpb.TensorServiceClient) error {
		got, err := c.Make(ctx, &tensorpb.Sized{Size: n, Seed: 5})
		if err != nil {
			return err
		}
		defer gdrcodec.ReleaseAll(got)
		sum, err := c.Digest(ctx, got)
		if err != nil {
			return err
		}
		if sum.Crc32C != want {
			return fmt.Errorf("digest %#x, want %#x", sum.Crc32C, want)
		}
		return nil
	}
	// running makes calls on c from several goroutines until stop is closed; after
	// each call it hands a value to whoever waits on progress, if anyone does.
	progress := make(chan struct{})
	running := func(call func(tensorpb.TensorServiceClient) error, c tensorpb.TensorServiceClient, stop chan struct{}) (wait func() error) {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var errs []error
		for range 4 {
			wg.Go(func() {
				for {
					if err := call(c); err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
					select {
					case <-stop:
						return
					case progress <- struct{}{}:
					default:
					}
				}
			})
		}
		return func() error {
			wg.Wait()
			return errors.Join(errs...)
		}
	}

	// Before Register: the options and codecs a program builds while calls run write
	// nothing; a gdrpc client works; a gdr call to the unregistered server is refused.
	stop := make(chan struct{})
	wait := running(plainCall, plain, stop)
	awaitCalls := func(n int) {
		for range n {
			<-progress
		}
	}
	awaitCalls(4)
	// A gdrpc server built before Register, while the calls run.
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTransport(transport.ModeTCP))
	if err != nil {
		return err
	}
	gdrSrv := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	tensorpb.RegisterTensorServiceServer(gdrSrv, &tensor.Server{})
	go gdrSrv.Serve(lis)
	defer gdrSrv.Stop()

	for range 20 {
		_ = gdrcodec.DialOptions()
		_ = gdrcodec.ServerOptions()
		a, b := net.Pipe()
		_ = gdrcodec.NewClientCodec(a).Close()
		_ = gdrcodec.NewServerCodec(b).Close()
	}
	// Lookups after whatever the calls above did, with nothing ordering them.
	awaitCalls(8)
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New(gdrpc.WithTransport(transport.ModeTCP)).DialOptions(insecure.NewCredentials())...)
	if err != nil {
		return err
	}
	defer cc.Close()
	gdr := tensorpb.NewTensorServiceClient(cc)
	_, err = gdr.Make(ctx, &tensorpb.Sized{Size: n, Seed: 5})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "gdrcodec.Register was not called") {
		close(stop)
		wait()
		return fmt.Errorf("gdr call before Register: %v, want FailedPrecondition naming Register", err)
	}
	close(stop)
	if err := wait(); err != nil {
		return fmt.Errorf("plain calls: %w", err)
	}

	// Register at start-up of the serving part, with no call in flight; then later
	// Register calls (options only) while gdr and plain calls run.
	gdrcodec.Register()
	stop = make(chan struct{})
	waitPlain := running(plainCall, plain, stop)
	waitGDR := running(gdrCall, gdr, stop)
	waitGDRBlob := running(plainCall, gdr, stop)
	for i := range 50 {
		gdrcodec.Register(gdrcodec.WithEagerThreshold(64<<10+i), gdrcodec.WithReceiveAllocator(devicebuf.NewHostAllocator()))
		_ = gdrcodec.DialOptions()
		_ = gdrcodec.ServerOptions()
	}
	gdrcodec.Register()
	close(stop)
	return errors.Join(waitPlain(), waitGDR(), waitGDRBlob())
}
