package e2e

import (
	"context"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestNftablesExclusive: starting the nftables backend removes what the iptables and BPF
// backends installed, and starting either of them removes the nftables tables.
func TestNftablesExclusive(t *testing.T) {
	nft := NftablesBackend()
	ipt := IptablesBackend(iptables.ModeNFT)
	bpfb := BestBPFBackend()
	switchBackends(t, []Backend{ipt, nft, bpfb}, []Backend{ipt, nft, bpfb, nft, ipt}, func(ctx context.Context, t *testing.T, env *Env, run int, b Backend) {
		if b.Name != nft.Name {
			for _, fam := range policy.Families() {
				if readTable(t, env.Node, fam) != nil {
					t.Errorf("run %d (%s): the %s nftables table stays", run, b.Name, fam)
				}
			}
			return
		}
		if s := bpfLeft(t, env); s != "" {
			t.Errorf("run %d (%s): BPF state left: %s", run, b.Name, s)
		}
		for _, fam := range policy.Families() {
			if s := installed(ctx, t, env, iptables.ModeNFT, fam); s != "" {
				t.Errorf("run %d (%s): the iptables chain stays:\n%s", run, b.Name, s)
			}
		}
	})
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
	auto := nft
	auto.Flags = []string{"--backend=auto"}
	ag := env.StartReadyNoFile(ctx, t, auto)
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
