// Package testutil holds helpers shared by tests. Production code never imports it.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// InCI reports whether the tests run in CI, where a privileged test that cannot run must fail.
func InCI() bool { return os.Getenv("CI") == "true" }

// RequirePrivileged stops a test that needs root (and the named tools on PATH). Outside CI it
// skips, so `go test` works for anyone; in CI it fails, so nothing silently stops being tested.
// With -short it always skips: `make unit` runs only what needs no privileges.
func RequirePrivileged(t testing.TB, tools ...string) {
	t.Helper()
	if testing.Short() && !InCI() {
		t.Skip("privileged test skipped in -short mode")
	}
	stop := t.Skipf
	if InCI() {
		stop = t.Fatalf
	}
	if os.Geteuid() != 0 {
		stop("this test needs root")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			stop("this test needs %s on PATH (make deps installs it)", tool)
		}
	}
}

// Unavailable stops a test whose environment lacks something it needs (a kernel feature, a
// report the kernel does not make), by the same rule as RequirePrivileged: a skip outside CI,
// a failure in CI.
func Unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if InCI() {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

// NotOnThisKernel stops a test whose case this kernel cannot present, as found by a probe (never
// by the version): a feature it lacks (tcx before 6.6; a context field that its
// BPF_PROG_TEST_RUN cannot set, such as ingress_ifindex on 5.10), or an earlier layout's programs
// that its verifier refuses, so that no node of this kernel ever ran them. It skips in CI too: the kernel matrix (test/kernels) runs the test
// on the kernels that have what it needs, and lists every such skip with its reason.
func NotOnThisKernel(t testing.TB, format string, args ...any) {
	t.Helper()
	t.Skipf("not on this kernel: "+format, args...)
}
