// Package sandbox tells why bpf(2) is refused, when the cause is the process's sandbox rather
// than the kernel: a seccomp filter (a container runtime's profile) or missing capabilities.
// The agent wraps its BPF errors with ExplainBPF, so that a fallback to iptables says what to
// change instead of repeating the library's "MEMLOCK may be too low".
package sandbox

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Capability bits, as in CapEff.
const (
	capSysAdmin = 21
	capBPF      = 39
)

// SeccompFilter is the Seccomp line of /proc/<pid>/status for a process under a seccomp filter
// (0 is none, 1 strict mode).
const SeccompFilter = 2

// statusPath is the calling thread's status: seccomp filters and capabilities are per thread
// (a container runtime sets them before exec, so every thread has them; a test may set them on
// one thread only).
const statusPath = "/proc/thread-self/status"

// Status is what the kernel reports about the sandbox of the calling thread.
type Status struct {
	// Seccomp is the Seccomp line: 0, 1 (strict) or SeccompFilter.
	Seccomp int
	// CapEff is the effective capability set.
	CapEff uint64
}

// ReadStatus reads the calling thread's Status.
func ReadStatus() (Status, error) {
	data, err := os.ReadFile(statusPath)
	if err != nil {
		return Status{}, fmt.Errorf("read %s: %w", statusPath, err)
	}
	return parseStatus(string(data))
}

func parseStatus(data string) (Status, error) {
	var st Status
	var haveSeccomp, haveCaps bool
	for _, line := range strings.Split(data, "\n") {
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		val = strings.TrimSpace(val)
		var err error
		switch key {
		case "Seccomp":
			st.Seccomp, err = strconv.Atoi(val)
			haveSeccomp = true
		case "CapEff":
			st.CapEff, err = strconv.ParseUint(val, 16, 64)
			haveCaps = true
		}
		if err != nil {
			return Status{}, fmt.Errorf("%s: %s %q: %w", statusPath, key, val, err)
		}
	}
	if !haveSeccomp || !haveCaps {
		return Status{}, fmt.Errorf("%s has no Seccomp or CapEff line", statusPath)
	}
	return st, nil
}

// Has reports whether the effective set holds capability bit.
func (s Status) Has(bit uint) bool { return s.CapEff&(1<<bit) != 0 }

// unknownCommand is a bpf(2) command no kernel has: the kernel's BPF code answers it with
// EINVAL after the generic checks, so any other answer comes from something in front of it.
const unknownCommand = 0xffff

// bpfRefused calls bpf(2) with an unknown command and returns the errno when something in front
// of the kernel's BPF code refuses it (a seccomp filter, or a security module); nil when the
// call reached that code. It needs no capability on Linux 5.8 and newer with CAP_BPF, nor on
// 6.5 and newer at all.
func bpfRefused() error {
	_, _, errno := unix.Syscall(unix.SYS_BPF, unknownCommand, 0, 0)
	if errno == unix.EINVAL {
		return nil
	}
	if errno == 0 {
		return errors.New("bpf(2) accepted an unknown command")
	}
	return errno
}

// DeniedError says that bpf(2) is stopped in front of the kernel's BPF code, by what, and what
// to do about it.
type DeniedError struct {
	// Errno is what bpf(2) is answered with (EPERM for the containers-common profile).
	Errno unix.Errno
	// Seccomp is true when the process runs under a seccomp filter, the likely cause; else a
	// security module is.
	Seccomp bool
	// Err is the error of the BPF operation that failed; nil when none was tried.
	Err error
}

func (e *DeniedError) Error() string {
	var msg string
	if e.Seccomp {
		msg = fmt.Sprintf("seccomp blocked bpf(2): this process runs under a seccomp filter (Seccomp: %d in /proc/self/status) "+
			"that answers bpf(2) with %s before the kernel sees it, so MEMLOCK is not the cause; "+
			"run the container with a seccomp profile that allows bpf(2) with CAP_BPF and perf_event_open(2) with CAP_PERFMON: "+
			"the RuntimeDefault of containerd 1.6.9+ and Docker 23+ does, that of podman and CRI-O (containers-common) does not, "+
			"deploy/seccomp/ip-masq-agent.json does (docs/install.md, Seccomp)",
			SeccompFilter, unix.ErrnoName(e.Errno))
	} else {
		msg = fmt.Sprintf("bpf(2) is refused before the kernel's BPF code sees it (%s for any command, and no seccomp filter: a security module such as SELinux?)",
			unix.ErrnoName(e.Errno))
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

func (e *DeniedError) Unwrap() error { return e.Err }

// BPFDenied returns why bpf(2) is stopped in front of the kernel (a *DeniedError), or nil when
// it reaches the kernel's BPF code.
func BPFDenied() error {
	st, err := ReadStatus()
	if err != nil {
		return nil // cannot tell; the operations themselves will fail if it is
	}
	return refusal(st, nil)
}

func refusal(st Status, err error) error {
	var errno unix.Errno
	if !errors.As(bpfRefused(), &errno) {
		return nil
	}
	return &DeniedError{Errno: errno, Seccomp: st.Seccomp == SeccompFilter, Err: err}
}

// ExplainBPF returns err with what really happened in front, when err is a bpf(2) refusal
// (EPERM or ENOSYS) that the sandbox explains: bpf(2) stopped in front of the kernel (a
// *DeniedError, see BPFDenied), or a process without CAP_BPF. Any other error is returned as
// it is.
func ExplainBPF(err error) error {
	if err == nil || !(errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS)) {
		return err
	}
	st, serr := ReadStatus()
	if serr != nil {
		return err
	}
	if r := refusal(st, err); r != nil {
		return r
	}
	if !st.Has(capBPF) && !st.Has(capSysAdmin) {
		return fmt.Errorf("this process lacks CAP_BPF (effective capabilities %#x): add BPF to the container's capabilities: %w", st.CapEff, err)
	}
	return err
}
