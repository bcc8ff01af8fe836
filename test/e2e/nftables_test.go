package e2e

import (
	"context"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// TestNftablesExclusive: starting the nftables backend removes what the iptables and BPF
// backends installed, and starting either of them removes the nftables tables.
func TestNftablesExclusive(t *testing.T) {
	nft := NftablesBackend()
	ipt := IptablesBackend(iptables.ModeNFT)
	bpfb := BPFBackend(tc.ModeTCX)
	for _, b := range []Backend{nft, ipt, bpfb} {
		requireBackend(t, b)
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewEnv(ctx, t, agentBin, []string{"--enable-ipv6"})
	ipt.Prepare(ctx, t, env)
	nft.Prepare(ctx, t, env)
	bpfb.Prepare(ctx, t, env)
	env.SetGood("", true)
	want := join(expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "fd00::1"), expect(Keep, "10.1.2.3"))
	for i, b := range []Backend{ipt, nft, bpfb, nft, ipt} {
		ag := env.StartAgent(ctx, t, b)
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		// Each of the two others goes right after the first apply.
		if err := ag.WaitLog(ctx, 1, "no other backend's state is left"); err != nil {
			t.Fatal(err)
		}
		env.Check(ctx, t, want, nil)
		b.Verify(ctx, t, env)
		if b.Name != nft.Name {
			for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
				if readTable(t, env.Node, fam) != nil {
					t.Errorf("run %d (%s): the %s nftables table stays", i+1, b.Name, fam)
				}
			}
		} else {
			if s := bpfLeft(t, env); s != "" {
				t.Errorf("run %d (%s): BPF state left: %s", i+1, b.Name, s)
			}
			for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
				if s := installed(ctx, t, env, iptables.ModeNFT, fam); s != "" {
					t.Errorf("run %d (%s): the iptables chain stays:\n%s", i+1, b.Name, s)
				}
			}
		}
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		if t.Failed() {
			t.Fatalf("run %d (%s) failed", i+1, b.Name)
		}
	}
}

// TestAutoTakesNftables: where BPF cannot run (--bpffs is no BPF filesystem) and kube-proxy
// keeps its nftables table, --backend auto runs the nftables backend and says why it passed
// over the others.
func TestAutoTakesNftables(t *testing.T) {
	nft := NftablesBackend()
	requireBackend(t, nft)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewBackendEnv(ctx, t, nft, nil)
	env.AgentFlags = []string{"--bpffs=" + t.TempDir()}
	env.SetGood("", true)
	auto := nft
	auto.Flags = []string{"--backend=auto"}
	ag := env.StartAgent(ctx, t, auto)
	if err := ag.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if ag.Count("the BPF datapath cannot run here; using nftables", "is not a BPF filesystem") != 1 {
		t.Errorf("auto did not log why it passed BPF over:\n%s", ag.Logs())
	}
	env.Check(ctx, t, join(expect(Masq, "8.8.8.8"), expect(Keep, "10.1.2.3")), nil)
	nft.Verify(ctx, t, env)
	m, err := ag.Scrape(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := m.Value("ip_masq_agent_datapath_info", Labels{"backend": "nftables", "attach_mode": "none"}); !ok || v != 1 {
		t.Errorf("datapath_info %v", m.Series("ip_masq_agent_datapath_info", nil))
	}
}
