package sandbox

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"

	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

func TestParseStatus(t *testing.T) {
	st, err := parseStatus("Name:\tip-masq-agent\nCapEff:\t000000c000003000\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\n")
	if err != nil {
		t.Fatal(err)
	}
	if st.Seccomp != SeccompFilter || !st.Has(capBPF) || st.Has(capSysAdmin) {
		t.Errorf("%+v", st)
	}
	if _, err := parseStatus("Name:\tx\n"); err == nil {
		t.Error("a status without Seccomp and CapEff parsed")
	}
}

// createMap is the bpf(2) operation the agent's probe makes first, made raw: the library's
// feature probes would cache what the filtered thread saw for the whole test binary.
func createMap() error {
	attr := struct{ mapType, keySize, valueSize, maxEntries uint32 }{unix.BPF_MAP_TYPE_ARRAY, 4, 4, 1}
	fd, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_MAP_CREATE, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	if errno != 0 {
		return fmt.Errorf("map create: %w", errno)
	}
	return unix.Close(int(fd))
}

// Under a filter like podman's default profile, the explanation names seccomp and what to do;
// without one, bpf(2) reaches the kernel and errors pass unchanged.
func TestExplainBPF(t *testing.T) {
	testutil.RequirePrivileged(t)
	if err := BPFDenied(); err != nil {
		t.Fatalf("bpf(2) is refused outside any filter: %v", err)
	}
	if err := createMap(); err != nil {
		t.Fatalf("outside any filter: %v", err)
	}
	other := fmt.Errorf("map create: %w", unix.EPERM)
	if got := ExplainBPF(other); got != other {
		t.Errorf("without a filter, as root: %v, want the error unchanged", got)
	}
	if got := ExplainBPF(unix.EINVAL); got != unix.EINVAL {
		t.Errorf("EINVAL: %v, want it unchanged", got)
	}

	var explained, denied error
	var st Status
	testutil.WithoutBPF(t, "", func() {
		var err error
		if st, err = ReadStatus(); err != nil {
			explained = err
			return
		}
		denied = BPFDenied()
		explained = ExplainBPF(createMap())
	})
	if de, ok := denied.(*DeniedError); !ok || de.Errno != unix.EPERM || !de.Seccomp || de.Err != nil {
		t.Errorf("BPFDenied under the filter: %v (%T)", denied, denied)
	}
	if st.Seccomp != SeccompFilter {
		t.Errorf("status under the filter: %+v", st)
	}
	var de *DeniedError
	if !errors.As(explained, &de) || !de.Seccomp || !errors.Is(explained, unix.EPERM) {
		t.Fatalf("under a filter that refuses bpf(2): %v (%T)", explained, explained)
	}
	for _, want := range []string{"seccomp blocked bpf(2)", "EPERM", "MEMLOCK is not the cause", "deploy/seccomp/ip-masq-agent.json", "map create"} {
		if !strings.Contains(explained.Error(), want) {
			t.Errorf("%q does not say %q", explained, want)
		}
	}
}

// A thread without CAP_BPF (and CAP_SYS_ADMIN) is told so: bpf(2) reaches the kernel, which
// refuses the map.
func TestExplainBPFWithoutCapability(t *testing.T) {
	testutil.RequirePrivileged(t)
	if v, err := os.ReadFile("/proc/sys/kernel/unprivileged_bpf_disabled"); err != nil || strings.TrimSpace(string(v)) == "0" {
		testutil.Unavailable(t, "unprivileged BPF is enabled (kernel.unprivileged_bpf_disabled=0, %v): maps need no CAP_BPF here", err)
	}
	var explained error
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread ends with its reduced capabilities
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			explained = err
			return
		}
		for _, bit := range []uint{capSysAdmin, capBPF} {
			data[bit/32].Effective &^= 1 << (bit % 32)
		}
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			explained = err
			return
		}
		explained = ExplainBPF(createMap())
	}()
	<-done
	if explained == nil || !strings.Contains(explained.Error(), "this process lacks CAP_BPF") || !errors.Is(explained, unix.EPERM) {
		t.Errorf("without CAP_BPF: %v", explained)
	}
}
