package nftables_test

import (
	"context"
	"errors"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// nft runs the nft command in the calling thread's namespace (inside testutil.InNetns).
func nft(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nft", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("nft %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// checkKernel compares the kernel's tables, read back over netlink, with the policy's layout:
// the same sets, each element with its rule's comment, nothing else; no IPv6 table without
// IPv6.
func checkKernel(t *testing.T, p *policy.Policy) {
	t.Helper()
	ctx := context.Background()
	for _, fam := range policy.Families() {
		st, err := nftables.NetlinkKernel{}.Table(ctx, fam, true)
		if err != nil {
			t.Fatal(err)
		}
		if !p.Enabled(fam) {
			if st != nil {
				t.Errorf("%s: a table without --enable-ipv6", fam)
			}
			continue
		}
		if st == nil {
			t.Fatalf("%s: no table", fam)
		}
		l := nftables.NewLayout(p, fam)
		want := map[string]map[string]string{}
		for _, s := range l.Sets {
			want[s.Name] = map[string]string{}
		}
		for _, e := range l.Elements {
			want[e.Set][e.Key.String()] = nftables.Comment(p.Rules(fam)[e.Rule])
		}
		got := map[string]map[string]string{}
		for name, s := range st.Sets {
			got[name] = map[string]string{}
			for k, e := range s.Elements {
				got[name][k.String()] = e.Comment
			}
		}
		if len(got) != len(want) {
			t.Errorf("%s: sets %v, want %v", fam, got, want)
		}
		for name, elems := range want {
			if g := got[name]; len(g) != len(elems) {
				t.Errorf("%s %s: %d elements, want %d", fam, name, len(g), len(elems))
			}
			for k, c := range elems {
				if got[name][k] != c {
					t.Errorf("%s %s %s: comment %q, want %q", fam, name, k, got[name][k], c)
				}
			}
		}
		if len(st.Chains[nftables.ChainPostrouting]) != len(l.Postrouting) || len(st.Chains[nftables.ChainMasq]) != len(l.Masq) {
			t.Errorf("%s: chains hold %d and %d rules, want %d and %d", fam, len(st.Chains[nftables.ChainPostrouting]),
				len(st.Chains[nftables.ChainMasq]), len(l.Postrouting), len(l.Masq))
		}
		// The SNAT chains, and no stale one after them.
		if len(st.Chains) != 2+len(l.SNAT) {
			t.Errorf("%s: %d chains, want 2 and %d SNAT chains", fam, len(st.Chains), len(l.SNAT))
		}
		for _, c := range l.SNAT {
			if len(st.Chains[c.Name]) != len(c.Rules) {
				t.Errorf("%s: chain %s holds %d rules, want %d", fam, c.Name, len(st.Chains[c.Name]), len(c.Rules))
			}
		}
		if (st.Outbound != nil) != (l.Outbound >= 0) {
			t.Errorf("%s: outbound counter %v, outbound rule %d", fam, st.Outbound, l.Outbound)
		}
		// What each masquerade set's lookup, and the outbound rule, SNAT to, read back from the
		// rules of the chains they go to.
		wantSNAT := map[string]netip.Addr{}
		for _, s := range l.Sets {
			if s.Address.IsValid() {
				wantSNAT[s.Name] = s.Address
			}
		}
		if l.Outbound >= 0 && p.Rules(fam)[l.Outbound].Address.IsValid() {
			wantSNAT[nftables.CounterOutbound] = p.Rules(fam)[l.Outbound].Address
		}
		if !maps.Equal(st.SNAT, wantSNAT) {
			t.Errorf("%s: SNAT read back %v, want %v", fam, st.SNAT, wantSNAT)
		}
	}
	checkDumpAddresses(t, nil, p)
}

// checkDumpAddresses checks the masquerade addresses of dump's counters (Inspect over kernel,
// given p and given no policy) against the installed policy p.
func checkDumpAddresses(t *testing.T, kernel nftables.Kernel, p *policy.Policy) (addressed int) {
	t.Helper()
	ctx := context.Background()
	for _, given := range []*policy.Policy{p, nil} {
		in, err := nftables.Inspect(ctx, kernel, given)
		if err != nil || in == nil {
			t.Fatalf("inspect: %v, %v", in, err)
		}
		cs, err := in.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if want := dumpedAddress(p, c); c.Address != want {
				t.Errorf("dump (policy given: %v): %s rule %d %s %s (%s) to %v, want %v",
					given != nil, c.Family, c.Rule, c.Action, c.Prefix, c.Origin, c.Address, want)
			}
			if c.Address.IsValid() {
				addressed++
			}
		}
	}
	return addressed
}

// dumpedAddress is the address dump must show for counter c of the table of p: that of its rule
// (by number; for a group of no rule, the first of its family, origin, prefix and action that
// has elements), where the rule has elements or is the outbound rule. A rule that earlier ones
// cover has no set to read an address from, and never matches.
func dumpedAddress(p *policy.Policy, c datapath.RuleCounter) netip.Addr {
	l := nftables.NewLayout(p, c.Family)
	rules := p.Rules(c.Family)
	read := func(i int) bool { return l.Pieces[i] > 0 || i == l.Outbound }
	if c.Rule > 0 {
		if !read(c.Rule - 1) {
			return netip.Addr{}
		}
		return rules[c.Rule-1].Address
	}
	for i, r := range rules {
		if r.Prefix == c.Prefix && r.Action == c.Action && r.Origin == c.Origin && read(i) {
			return r.Address
		}
	}
	return netip.Addr{}
}

// The backend against the kernel, through nft and netlink, in a namespace of its own: random
// policies (with --to-ports and IPv6) applied one after the other are what the kernel then
// holds; drift is found and repaired; cleanup removes both tables.
func TestKernel(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "nft")
	ns := testutil.NewNetns(t)
	testutil.InNetns(t, ns, func() {
		ctx := context.Background()
		b, err := nftables.New(ctx, nftables.Options{})
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(15, 2))
		var p *policy.Policy
		for i := range 12 {
			cfg := policytest.Config(r, r.IntN(20))
			if i%4 != 3 {
				cfg = policytest.WithAddresses(r, cfg)
			}
			p = compile(cfg, i%3 != 2)
			if i%2 == 0 {
				p.ToPorts = policy.PortRanges{{First: 1024, Last: 29999}, {First: 32768, Last: 65535}}
			}
			if err := b.Apply(ctx, p); err != nil {
				t.Fatalf("apply %d: %v", i, err)
			}
			checkKernel(t, p)
			if kinds, err := b.CheckDrift(ctx); err != nil || len(kinds) != 0 {
				t.Fatalf("apply %d: drift right after: %v, %v", i, kinds, err)
			}
		}
		p = compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.0.0.0/8"), pfx("fd00::/8")}, MasqOutBound: true, MasqOutBoundIPv6: true,
			MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("10.1.0.0/16"), Address: netip.MustParseAddr("192.0.2.11")}}}, true)
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		for _, d := range []struct {
			args []string
			what []string
		}{
			{[]string{"flush", "set", "ip", nftables.TableName, "return-8"}, []string{datapath.DriftSet}},
			{[]string{"delete", "table", "ip6", nftables.TableName}, []string{datapath.DriftTable}},
			{[]string{"insert", "rule", "ip", nftables.TableName, nftables.ChainPostrouting, "return"}, []string{datapath.DriftChain}},
			{[]string{"flush", "chain", "ip", nftables.TableName, nftables.SNATChainName(0)}, []string{datapath.DriftChain}},
			{[]string{"flush chain ip " + nftables.TableName + " " + nftables.ChainPostrouting + "; delete chain ip " + nftables.TableName + " " +
				nftables.ChainPostrouting}, []string{datapath.DriftChain}},
		} {
			nft(t, d.args...)
			if strings.Contains(d.args[0], "delete chain") {
				// A chain that is gone reads as missing, not as one without rules.
				st, err := nftables.NetlinkKernel{}.Table(ctx, policy.IPv4, false)
				if _, there := st.Chains[nftables.ChainPostrouting]; err != nil || there {
					t.Errorf("the deleted chain reads as %v there, %v", st.Chains[nftables.ChainPostrouting], err)
				}
			}
			// The element walk is due at most every so often; the check finds the damage by then.
			var kinds []string
			if err := testutil.Poll(5*time.Second, 0, func() error {
				if kinds, err = b.CheckDrift(ctx); err == nil && len(kinds) == 0 {
					return testutil.NotYet("a drift")
				}
				return err
			}); err != nil && !errors.Is(err, testutil.ErrNotYet) {
				t.Fatal(err)
			}
			if !slices.Equal(kinds, d.what) {
				t.Errorf("nft %s: drift %v, want %v", strings.Join(d.args, " "), kinds, d.what)
			}
			if err := b.Apply(ctx, p); err != nil {
				t.Fatal(err)
			}
			checkKernel(t, p)
			if kinds, err := b.CheckDrift(ctx); err != nil || len(kinds) != 0 {
				t.Errorf("nft %s: drift after the repair: %v, %v", strings.Join(d.args, " "), kinds, err)
			}
		}
		for range 2 {
			if err := b.Cleanup(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if out := nft(t, "list", "tables"); strings.Contains(out, nftables.TableName) {
			t.Errorf("cleanup left %s", out)
		}
	})
}

// An element batch against the kernel: thousands of elements, more than one netlink message
// holds, arrive with their comments and their set's counter; a batch the kernel refuses in
// its last message (a key to delete that is not there) changes nothing, and says why; the
// elements read by key are those a walk of the set reads, those not in the set left out; a
// flush and additions in one batch leave exactly the additions. Both families.
func TestChangeElements(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "nft")
	ns := testutil.NewNetns(t)
	testutil.InNetns(t, ns, func() {
		ctx := context.Background()
		k := nftables.NetlinkKernel{}
		for _, fam := range policy.Families() {
			family, typ := "ip", "ipv4_addr"
			if fam == policy.IPv6 {
				family, typ = "ip6", "ipv6_addr"
			}
			nft(t, "add", "table", family, nftables.TableName)
			nft(t, "add", "set", family, nftables.TableName, "s", "{ type "+typ+" ; counter ; }")
			key := func(i int) netip.Addr {
				if fam == policy.IPv6 {
					return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i), 14: byte(i >> 8)})
				}
				return netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0})
			}
			elements := func(from, to int) []nftables.NewElement {
				var out []nftables.NewElement
				for i := from; i < to; i++ {
					out = append(out, nftables.NewElement{Key: key(i), Comment: "nonMasqueradeCIDRs " + netip.PrefixFrom(key(i), 24).String()})
				}
				return out
			}
			read := func() map[netip.Addr]nftables.ElementState {
				t.Helper()
				st, err := k.Table(ctx, fam, true)
				if err != nil || st == nil || st.Sets["s"] == nil {
					t.Fatalf("%s: read back: %v, %v", fam, st, err)
				}
				return st.Sets["s"].Elements
			}
			const n = 3000
			if err := k.ChangeElements(ctx, fam, []nftables.SetChange{{Set: "s", Add: elements(0, n)}}); err != nil {
				t.Fatalf("%s: %v", fam, err)
			}
			got := read()
			if len(got) != n {
				t.Fatalf("%s: %d elements, want %d", fam, len(got), n)
			}
			for _, e := range elements(0, n) {
				if got[e.Key].Comment != e.Comment {
					t.Fatalf("%s: %s has comment %q, want %q", fam, e.Key, got[e.Key].Comment, e.Comment)
				}
			}
			if out := nft(t, "list", "set", family, nftables.TableName, "s"); !strings.Contains(out, key(n-1).String()+" counter packets 0 bytes 0") {
				t.Errorf("%s: the last element has no counter:\n%.400s", fam, out)
			}

			err := k.ChangeElements(ctx, fam, []nftables.SetChange{{Set: "s", Delete: []netip.Addr{key(0)}, Add: elements(n, n+1000)},
				{Set: "s", Delete: []netip.Addr{key(n + 2000)}}})
			if err == nil || !strings.Contains(err.Error(), "no such file or directory") {
				t.Errorf("%s: a batch deleting a missing key: %v", fam, err)
			}
			if got := read(); len(got) != n {
				t.Errorf("%s: the refused batch left %d elements, want %d", fam, len(got), n)
			}

			// Read by key: more keys than one request holds, some of them (the first, the last,
			// a run) not in the set; the counts as nft set them.
			nft(t, "add", "element", family, nftables.TableName, "s", "{ "+key(n+1).String()+" counter packets 7 bytes 420 comment \"seven\" }")
			var keys []netip.Addr
			keys = append(keys, key(n+2))
			for i := range n + 2 {
				keys = append(keys, key(i))
			}
			keys = append(keys, key(n+3), key(n+4))
			byKey, err := k.Elements(ctx, fam, "s", keys)
			if err != nil {
				t.Fatalf("%s: elements by key: %v", fam, err)
			}
			walked := read()
			if len(byKey) != len(walked) {
				t.Errorf("%s: %d elements by key, %d walked", fam, len(byKey), len(walked))
			}
			for k, e := range walked {
				if byKey[k] != e {
					t.Errorf("%s: %s by key %+v, walked %+v", fam, k, byKey[k], e)
				}
			}
			if e := byKey[key(n+1)]; e.Count != (nftables.Count{Packets: 7, Bytes: 420}) || e.Comment != "seven" {
				t.Errorf("%s: the element nft added reads as %+v", fam, e)
			}

			if err := k.ChangeElements(ctx, fam, []nftables.SetChange{{Set: "s", Flush: true, Add: elements(n, n+10)}}); err != nil {
				t.Fatalf("%s: %v", fam, err)
			}
			got = read()
			if len(got) != 10 {
				t.Errorf("%s: %d elements after the flush, want 10", fam, len(got))
			}
			for _, e := range elements(n, n+10) {
				if got[e.Key].Comment != e.Comment {
					t.Errorf("%s: %s: comment %q after the flush", fam, e.Key, got[e.Key].Comment)
				}
			}
		}
	})
}
