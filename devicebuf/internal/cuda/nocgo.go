//go:build !cgo || nocuda

package cuda

import (
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// Default returns the driver of this build: without cgo (or with the nocuda tag) there is
// none, and every call reports ErrNotSupported.
func Default() driver.Driver { return absent{} }

var errAbsent = fmt.Errorf("devicebuf: CUDA driver: built without cgo or with the nocuda tag: %w", driver.ErrNotSupported)

type absent struct{}

func (absent) Init() error                                        { return errAbsent }
func (absent) DriverVersion() (int, error)                        { return 0, errAbsent }
func (absent) DeviceCount() (int, error)                          { return 0, errAbsent }
func (absent) DeviceUUID(int) ([16]byte, error)                   { return [16]byte{}, errAbsent }
func (absent) DeviceName(int) (string, error)                     { return "", errAbsent }
func (absent) DevicePCIBusID(int) (string, error)                 { return "", errAbsent }
func (absent) DeviceTotalMem(int) (uint64, error)                 { return 0, errAbsent }
func (absent) DeviceAttribute(int, driver.Attribute) (int, error) { return 0, errAbsent }
func (absent) MemAlloc(int, int) (uintptr, error)                 { return 0, errAbsent }
func (absent) MemFree(int, uintptr) error                         { return errAbsent }
func (absent) SetSyncMemops(int, uintptr) error                   { return errAbsent }
func (absent) MemAddressRange(int, uintptr) (uintptr, int, error) { return 0, 0, errAbsent }
func (absent) MemHostRegister(uintptr, int) error                 { return errAbsent }
func (absent) MemHostUnregister(uintptr) error                    { return errAbsent }
func (absent) StreamCreate(int, bool) (driver.Stream, error)      { return 0, errAbsent }
func (absent) StreamWaitEvent(driver.Stream, driver.Event) error  { return errAbsent }
func (absent) StreamAdopt(int, driver.Stream) error               { return errAbsent }
func (absent) StreamDisown(driver.Stream) error                   { return errAbsent }
func (absent) EventCreate(int, bool) (driver.Event, error)        { return 0, errAbsent }
func (absent) EventRecord(driver.Event, driver.Stream) error      { return errAbsent }
func (absent) EventSynchronize(driver.Event) error                { return errAbsent }
func (absent) EventQuery(driver.Event) (bool, error)              { return false, errAbsent }
func (absent) EventDestroy(driver.Event) error                    { return errAbsent }
func (absent) IpcGetEventHandle(driver.Event) ([64]byte, error)   { return [64]byte{}, errAbsent }
func (absent) IpcOpenEventHandle(int, [64]byte) (driver.Event, error) {
	return 0, errAbsent
}
func (absent) MemsetZero(int, uintptr, int) error              { return errAbsent }
func (absent) StreamSynchronize(driver.Stream) error           { return errAbsent }
func (absent) StreamDestroy(driver.Stream) error               { return errAbsent }
func (absent) FlushRDMAWrites(int) error                       { return errAbsent }
func (absent) IpcCloseMemHandle(int, uintptr) error            { return errAbsent }
func (absent) IpcOpenMemHandle(int, [64]byte) (uintptr, error) { return 0, errAbsent }
func (absent) IpcGetMemHandle(int, uintptr) ([64]byte, error)  { return [64]byte{}, errAbsent }
func (absent) Memcpy(driver.Dir, int, uintptr, int, uintptr, int, driver.Stream) error {
	return errAbsent
}
