package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// Under a seccomp filter that refuses bpf(2), as podman's and CRI-O's default profile does for a
// container without CAP_SYS_ADMIN: --backend=auto falls back to iptables and says that seccomp
// is the cause and what to do (not "MEMLOCK may be too low"); cleanup removes the tcx links of an
// earlier agent through their pins and says so (not "0 program attachments removed"). The
// container suite (test/container) runs the same under podman itself.
func TestWithoutBPFSyscall(t *testing.T) {
	b := BestBPFBackend()
	requireBackend(t, b)
	testutil.RequirePrivileged(t, "iptables-nft-restore")
	nobpf := testutil.WithoutBPFExecutable(t, agentBin)

	t.Run("agent", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
		defer cancel()
		// As in such a container: the DaemonSet's capabilities (no SYS_RESOURCE) and a
		// container's RLIMIT_MEMLOCK, which the agent cannot lift; seccomp is still the cause.
		env := NewEnv(ctx, t, testutil.WithoutBPFExecutable(t, restricted(t, daemonSetCapabilities(t))), nil)
		b.Prepare(ctx, t, env)
		auto := b
		auto.Flags = []string{"--backend=auto"}
		a := env.StartAgent(ctx, t, auto)
		if err := a.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		_, metrics, err := a.Get(ctx, "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		if info := grepLines(metrics, "ip_masq_agent_datapath_info{"); !strings.Contains(info, `backend="iptables"`) {
			t.Errorf("datapath without bpf(2): %s", info)
		}
		fallback := grepLines(a.Logs(), "the BPF datapath cannot run here")
		for _, want := range []string{"seccomp blocked bpf(2)", "EPERM", "MEMLOCK is not the cause", "deploy/seccomp/ip-masq-agent.json"} {
			if !strings.Contains(fallback, want) {
				t.Errorf("the fallback does not say %q:\n%s", want, a.Logs())
			}
		}
		if strings.Contains(fallback, "RLIMIT_MEMLOCK") {
			t.Errorf("the fallback blames RLIMIT_MEMLOCK:\n%s", fallback)
		}
	})

	t.Run("cleanup", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
		defer cancel()
		env := NewEnv(ctx, t, agentBin, nil)
		b.Prepare(ctx, t, env)
		a := env.StartAgent(ctx, t, b)
		if err := a.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := a.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		if progs, _ := env.UplinkPrograms(t); len(progs) != 2 {
			t.Fatalf("the agent left %v on the uplink, want its two programs", progs)
		}
		out, err := NSExec(ctx, env.Node, "", nobpf, env.DatapathArgs("cleanup", b)...)
		if err != nil {
			t.Fatalf("cleanup without bpf(2): %v\n%s", err, out)
		}
		// tcx links go with their pins, which need no bpf(2); tc filters go through netlink.
		removed := "2 tcx link pins removed"
		if b.Info.AttachMode == tc.ModeTC {
			removed = "2 program attachments removed"
		}
		for _, want := range []string{removed, "seccomp blocked bpf(2)", "pins under " + env.PinRoot() + " removed"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("cleanup does not say %q:\n%s", want, out)
			}
		}
		// Nothing held the links but their pins, so the programs go with them: shortly after,
		// since the kernel frees a link whose last reference went in a work item of its own.
		if err := testutil.Poll(5*time.Second, 10*time.Millisecond, func() error {
			if s := bpfLeft(t, env); s != "" {
				return testutil.NotYet("nothing left after cleanup: %s", s)
			}
			return nil
		}); err != nil {
			t.Error(err)
		}
		t.Logf("cleanup: %s", strings.TrimSpace(string(out)))
	})
}
