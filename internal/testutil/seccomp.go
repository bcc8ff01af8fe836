package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// execWithoutBPFEnv names the program that a test binary started by a WithoutBPFExecutable
// script runs under the filter, with the script's arguments.
const execWithoutBPFEnv = "IP_MASQ_AGENT_TEST_EXEC_WITHOUT_BPF"

// A test binary asked to by its environment installs the filter and becomes the program (the
// filter is kept across exec), before any test code runs.
func init() {
	prog := os.Getenv(execWithoutBPFEnv)
	if prog == "" {
		return
	}
	runtime.LockOSThread() // the filter binds this thread, the one that execs
	if err := os.Unsetenv(execWithoutBPFEnv); err != nil {
		fmt.Fprintln(os.Stderr, "testutil:", err)
		os.Exit(126)
	}
	if err := denyBPF(); err != nil {
		fmt.Fprintln(os.Stderr, "testutil:", err)
		os.Exit(126)
	}
	err := unix.Exec(prog, append([]string{prog}, os.Args[1:]...), os.Environ())
	fmt.Fprintf(os.Stderr, "testutil: exec %s: %v\n", prog, err)
	os.Exit(127)
}

// WithoutBPFExecutable returns an executable that runs bin, with its arguments, under a seccomp
// filter that answers bpf(2) with EPERM, as a container under the podman or CRI-O default
// profile without CAP_SYS_ADMIN runs: the running test binary installs the filter, then execs
// bin.
func WithoutBPFExecutable(t testing.TB, bin string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "without-bpf")
	script := fmt.Sprintf("#!/bin/sh\nexec env %s=%s %s \"$@\"\n", execWithoutBPFEnv, bin, self)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// WithoutBPF runs fn on a thread of its own under a seccomp filter that answers bpf(2) with
// EPERM, as the podman and CRI-O default profile does for a container without CAP_SYS_ADMIN;
// inside the named network namespace when ns is not empty. The filter binds only that thread
// (no TSYNC), and the thread is never reused: it ends with fn. fn must not start goroutines
// that expect the filter.
func WithoutBPF(t testing.TB, ns string, fn func()) {
	t.Helper()
	var nsFile *os.File
	if ns != "" {
		f, err := os.Open("/run/netns/" + ns)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		nsFile = f
	}
	started := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if nsFile != nil {
			if err := unix.Setns(int(nsFile.Fd()), unix.CLONE_NEWNET); err != nil {
				started <- fmt.Errorf("enter netns %s: %w", ns, err)
				return
			}
		}
		if err := denyBPF(); err != nil {
			started <- err
			return
		}
		started <- nil
		fn()
	}()
	if err := <-started; err != nil {
		<-done
		t.Fatal(err)
	}
	<-done
}

// denyBPF installs on the calling thread a filter that fails bpf(2) with EPERM and allows the
// rest. It checks no architecture: the tests run native system calls only.
func denyBPF() error {
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: unix.SYS_BPF},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	// Without privileges, a filter needs no_new_privs; it binds this thread only as well.
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&prog)), 0, 0); err != nil {
		return fmt.Errorf("install seccomp filter: %w", err)
	}
	runtime.KeepAlive(filter)
	return nil
}
