package e2e

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// NftablesBackend is the nftables datapath, on a node whose kube-proxy runs in nftables mode.
func NftablesBackend() Backend {
	// NAT is conntrack's, as on iptables: the same refusals and expiry.
	ipt := IptablesBackend(iptables.ModeNFT)
	b := Backend{
		Name:       "nftables",
		Flags:      []string{"--backend=nftables"},
		Tools:      []string{"nft"},
		Iptables:   iptables.ModeNFT,
		Info:       datapath.Info{Backend: nftables.Name, AttachMode: datapath.AttachNone},
		Prepare:    prepareKubeProxyNftables,
		Refusals:   ipt.Refusals,
		FastExpiry: ipt.FastExpiry,
		Verify: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			if diff := nftablesDiff(ctx, t, env); diff != "" {
				t.Errorf("installed tables differ from what render --backend=nftables installs: %s", diff)
			}
		},
		Gone: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			for _, fam := range policy.Families() {
				if st := readTable(t, env.Node, fam); st != nil {
					t.Errorf("the %s table is still there", fam)
				}
			}
		},
		DriftWhat: []string{datapath.DriftTable},
		Drift: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			nftDo(ctx, t, env, "delete table ip "+nftables.TableName)
		},
		Damages: nftablesDamages(),
	}
	return b
}

// prepareKubeProxyNftables gives the node what kube-proxy's nftables mode keeps, in both
// families: a table of its own whose forward chain accepts established and related traffic.
// It keeps conntrack running in the namespace, as the iptables backend's preparation does.
func prepareKubeProxyNftables(ctx context.Context, t testing.TB, env *Env) {
	t.Helper()
	for _, fam := range []string{"ip", "ip6"} {
		nftDo(ctx, t, env, "add table "+fam+" "+nftables.KubeProxyTable+"\n"+
			"add chain "+fam+" "+nftables.KubeProxyTable+" forward { type filter hook forward priority -110 ; }\n"+
			"add rule "+fam+" "+nftables.KubeProxyTable+" forward ct state established,related accept\n")
	}
}

// nftDo runs an nft script in the node.
func nftDo(ctx context.Context, t testing.TB, env *Env, script string) {
	t.Helper()
	if _, err := NSExec(ctx, env.Node, script, "nft", "-f", "-"); err != nil {
		t.Fatalf("nft: %v\n%s", err, script)
	}
}

// readTable reads a family's table in namespace ns over netlink, nil when there is none.
func readTable(t testing.TB, ns string, fam policy.Family) *nftables.TableState {
	t.Helper()
	var st *nftables.TableState
	err := testutil.Do(ns, func() error {
		var err error
		st, err = nftables.NetlinkKernel{}.Table(context.Background(), fam, true)
		return err
	})
	if err != nil {
		t.Fatalf("read the %s table: %v", fam, err)
	}
	return st
}

// nftablesDiff compares the node's tables with those render --backend=nftables installs, for
// the env's flags and last good configuration, in a scratch namespace: the same chains (rule for
// rule, as the kernel holds them), sets, elements with their comments, and outbound counter;
// counts aside. It returns what differs, "" when nothing does.
func nftablesDiff(ctx context.Context, t testing.TB, env *Env) string {
	t.Helper()
	scratch := testutil.NewNetns(t)
	if _, err := NSExec(ctx, scratch, env.Render(ctx, t, "--backend=nftables"), "nft", "-f", "-"); err != nil {
		t.Fatalf("load render's transactions: %v", err)
	}
	for _, fam := range policy.Families() {
		got, want := readTable(t, env.Node, fam), readTable(t, scratch, fam)
		switch {
		case got == nil && want == nil:
			continue
		case got == nil:
			return fam.String() + ": no table"
		case want == nil:
			return fam.String() + ": a table render does not install"
		}
		if !maps.EqualFunc(got.Chains, want.Chains, slices.Equal) {
			return fam.String() + ": the chains differ"
		}
		if (got.Outbound == nil) != (want.Outbound == nil) {
			return fam.String() + ": the outbound counter differs"

		}
		if !maps.EqualFunc(got.Sets, want.Sets, func(a, b *nftables.SetState) bool {
			return maps.EqualFunc(a.Elements, b.Elements, func(x, y nftables.ElementState) bool { return x.Comment == y.Comment })
		}) {
			return fam.String() + ": the sets differ"
		}
	}
	return ""
}

// nftablesDamages change the IPv4 table, each with one nft transaction.
func nftablesDamages() []Damage {
	repaired := func(ctx context.Context, t testing.TB, env *Env) bool {
		t.Helper()
		return nftablesDiff(ctx, t, env) == ""
	}
	return []Damage{
		{Name: "table deleted", What: []string{datapath.DriftTable}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				nftDo(ctx, t, env, "delete table ip "+nftables.TableName)
			}},
		{Name: "set flushed", What: []string{datapath.DriftSet}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				t.Helper()
				st := readTable(t, env.Node, policy.IPv4)
				if st == nil || len(st.Sets) == 0 {
					t.Fatal("no IPv4 set to flush")
				}
				nftDo(ctx, t, env, "flush set ip "+nftables.TableName+" "+slices.Sorted(maps.Keys(st.Sets))[0])
			}},
		{Name: "chain changed", What: []string{datapath.DriftChain}, Repaired: repaired,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				nftDo(ctx, t, env, "insert rule ip "+nftables.TableName+" "+nftables.ChainPostrouting+" return")
			}},
	}
}
