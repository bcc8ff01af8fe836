package e2e

import (
	"strings"
	"testing"
)

// TestBackendsEnv: the environment narrows the backends by prefix, and a name that matches none
// is an error rather than a suite with nothing in it.
func TestBackendsEnv(t *testing.T) {
	t.Setenv(BackendsEnv, "bpf, nftables")
	got := names(Backends())
	if len(got) != len(BPFModes())+1 || got[len(got)-1] != "nftables" {
		t.Errorf("%s=bpf, nftables: %v", BackendsEnv, got)
	}
	for _, n := range got[:len(got)-1] {
		if !strings.HasPrefix(n, "bpf") {
			t.Errorf("%s=bpf, nftables: %v", BackendsEnv, got)
		}
	}
	t.Setenv(BackendsEnv, "bfp")
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), `"bfp" names none`) {
			t.Errorf("%s=bfp: recovered %v, want a panic naming it", BackendsEnv, r)
		}
	}()
	t.Errorf("%s=bfp: %v, want a panic", BackendsEnv, names(Backends()))
}
