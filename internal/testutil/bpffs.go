package testutil

import (
	"testing"

	"golang.org/x/sys/unix"
)

// MountBPFFS mounts a BPF filesystem of the test's own in a temporary directory (tests never
// pin into the host's /sys/fs/bpf) and unmounts it when the test ends, after the cleanups
// registered later (an agent still holding pins there) have run.
func MountBPFFS(t testing.TB) string {
	t.Helper()
	RequirePrivileged(t)
	dir := t.TempDir()
	if err := unix.Mount("bpffs", dir, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("mount bpffs at %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount bpffs at %s: %v", dir, err)
		}
	})
	return dir
}
