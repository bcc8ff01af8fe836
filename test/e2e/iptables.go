package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// IptablesBackend is the iptables datapath on a node that uses mode ("nft" or "legacy"): Prepare
// gives the node the rules kube-proxy would have there, so the agent's mode detection has a mode
// to follow.
func IptablesBackend(mode iptables.Mode) Backend {
	b := Backend{
		Name:     "iptables-" + string(mode),
		Flags:    []string{"--backend=iptables"},
		Tools:    []string{"iptables-" + string(mode) + "-restore", "ip6tables-" + string(mode) + "-restore"},
		Iptables: mode,
		Info:     datapath.Info{Backend: iptables.Name, AttachMode: datapath.AttachNone},
		Verify: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			verifyIptables(ctx, t, env, mode)
		},
		Gone: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			for _, m := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
				for _, fam := range policy.Families() {
					if s := installed(ctx, t, env, m, fam); s != "" {
						t.Errorf("%s %s still holds:\n%s", m, fam, s)
					}
				}
			}
		},
		DriftWhat: []string{datapath.DriftChain, datapath.DriftJump},
		Refusals: func(ctx context.Context, t testing.TB, env *Env) float64 {
			t.Helper()
			// A SYN that finds no free port clashes when its conntrack entry is confirmed: counted
			// under insert_failed (and drop), then dropped.
			return float64(ConntrackStats(t, env.Node)["insert_failed"])
		},
		FastExpiry: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			for _, state := range []string{"fin_wait", "close_wait", "last_ack", "time_wait", "close"} {
				if err := WriteSysctl(env.Node, "net.netfilter.nf_conntrack_tcp_timeout_"+state, "1"); err != nil {
					t.Fatal(err)
				}
			}
		},
		Damages: iptablesDamages(mode),
		Drift: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			chain := env.FlagValue("masq-chain", iptables.DefaultChain)
			jump := iptables.JumpRule(chain)
			deleteJump := append([]string{"-t", "nat", "-D", jump.Chain}, jump.Args()...)
			for _, args := range [][]string{{"-t", "nat", "-F", chain}, deleteJump} {
				if _, err := NSExec(ctx, env.Node, "", "iptables-"+string(mode), args...); err != nil {
					t.Fatalf("drift: %v", err)
				}
			}
		},
	}
	b.Prepare = func(ctx context.Context, t testing.TB, env *Env) {
		t.Helper()
		prepareNode(ctx, t, env, mode)
	}
	return b
}

// iptablesDamages change the IPv4 chain or jump, each in one iptables-restore transaction (so
// that the agent never sees half a damage).
func iptablesDamages(mode iptables.Mode) []Damage {
	restore := func(ctx context.Context, t testing.TB, env *Env, tx *iptables.Transaction) {
		t.Helper()
		if _, err := NSExec(ctx, env.Node, string(tx.Bytes()), "iptables-"+string(mode)+"-restore", "--noflush"); err != nil {
			t.Fatalf("damage: %v", err)
		}
	}
	chain := func(env *Env) string { return env.FlagValue("masq-chain", iptables.DefaultChain) }
	repaired := func(ctx context.Context, t testing.TB, env *Env) bool {
		t.Helper()
		return installed(ctx, t, env, mode, policy.IPv4) == env.Render(ctx, t)
	}
	return []Damage{
		{Name: "jump deleted", What: []string{datapath.DriftJump}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				tx := iptables.NewTransaction()
				tx.Delete(iptables.JumpRule(chain(env)))
				restore(ctx, t, env, tx)
			}},
		{Name: "chain flushed", What: []string{datapath.DriftChain}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				tx := iptables.NewTransaction()
				tx.Declare(chain(env))
				restore(ctx, t, env, tx)
			}},
		{Name: "chain and jump deleted", What: []string{datapath.DriftChain, datapath.DriftJump}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				tx := iptables.NewTransaction()
				tx.Delete(iptables.JumpRule(chain(env)))
				tx.Declare(chain(env))
				tx.DeleteChain(chain(env))
				restore(ctx, t, env, tx)
			}},
	}
}

// ConntrackStats sums, over the CPUs, the conntrack statistics of namespace ns
// (/proc/net/stat/nf_conntrack: insert_failed, drop, ...).
func ConntrackStats(t testing.TB, ns string) map[string]uint64 {
	t.Helper()
	var data []byte
	if err := testutil.Do(ns, func() error {
		var err error
		// thread-self: /proc/self/net would be the namespace of the process' first thread.
		data, err = os.ReadFile("/proc/thread-self/net/stat/nf_conntrack")
		return err
	}); err != nil {
		t.Fatalf("conntrack statistics of %s: %v", ns, err)
	}
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	names := strings.Fields(lines[0])
	out := map[string]uint64{}
	for _, l := range lines[1:] {
		for i, v := range strings.Fields(l) {
			n, err := strconv.ParseUint(v, 16, 64)
			if err != nil || i >= len(names) {
				t.Fatalf("conntrack statistics line %q", l)
			}
			out[names[i]] += n
		}
	}
	return out
}

// prepareNode adds, in mode and for both families, the conntrack rule every kube-proxy node has
// (KUBE-FORWARD accepts RELATED,ESTABLISHED). Besides marking the mode, it keeps conntrack
// running in the namespace: a node whose only conntrack user is the MASQUERADE rule stops
// tracking a family when the last MASQUERADE rule of that family goes, and its established
// masqueraded flows then break. Real nodes never get there; the test node must not either.
func prepareNode(ctx context.Context, t testing.TB, env *Env, mode iptables.Mode) {
	t.Helper()
	for _, tool := range []string{"iptables", "ip6tables"} {
		if _, err := NSExec(ctx, env.Node, "", tool+"-"+string(mode), "-t", "filter", "-A", "FORWARD",
			"-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED",
			"-m", "comment", "--comment", "e2e: kube-proxy-like forward rule", "-j", "ACCEPT"); err != nil {
			t.Fatalf("prepare %s node: %v", mode, err)
		}
	}
}

// installed returns the chain and jumps of the env's chain in one mode and family, in render's
// layout (a comment line naming the restore tool, then the payload), or "" when there are none.
func installed(ctx context.Context, t testing.TB, env *Env, mode iptables.Mode, fam policy.Family) string {
	t.Helper()
	chain := env.FlagValue("masq-chain", iptables.DefaultChain)
	tool := "iptables"
	if fam == policy.IPv6 {
		tool = "ip6tables"
	}
	out, err := NSExec(ctx, env.Node, "", tool+"-"+string(mode)+"-save")
	if err != nil {
		t.Fatalf("read back: %v", err)
	}
	nat, err := iptables.ParseSave(out, "nat")
	if err != nil {
		t.Fatalf("read back: %v", err)
	}
	jumps := nat.RulesTargeting(chain)
	if !nat.HasChain(chain) && len(jumps) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("# " + tool + "-restore --noflush\n*nat\n")
	// The source rules' chains, which the main chain goes to, in rule order as render gives
	// them (iptables-legacy-save sorts chains by name).
	sources := nat.SourceChains(chain)
	if nat.HasChain(chain) {
		b.WriteString(":" + chain + " - [0:0]\n")
	}
	for _, c := range sources {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	for _, c := range append([]string{chain}, sources...) {
		for _, r := range nat.ChainRules(c) {
			b.WriteString(r.Text() + "\n")
		}
	}
	for _, r := range jumps {
		b.WriteString(r.Text() + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// verifyIptables checks that the chain and jump the agent installed, read back with
// iptables-save inside the node, equal `render`'s output for the same flags and configuration,
// and that the other mode holds nothing.
func verifyIptables(ctx context.Context, t testing.TB, env *Env, mode iptables.Mode) {
	t.Helper()
	want := env.Render(ctx, t)
	got := installed(ctx, t, env, mode, policy.IPv4) + installed(ctx, t, env, mode, policy.IPv6)
	if got != want {
		t.Errorf("installed (iptables-%s-save) differs from render:\n--- installed\n%s--- render\n%s", mode, got, want)
	}
	other := iptables.ModeLegacy
	if mode == iptables.ModeLegacy {
		other = iptables.ModeNFT
	}
	for _, fam := range policy.Families() {
		if s := installed(ctx, t, env, other, fam); s != "" {
			t.Errorf("the agent also installed into %s (%s):\n%s", other, fam, s)
		}
	}
}
