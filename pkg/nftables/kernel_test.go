package nftables_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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
		rules := l.Rules(p)
		for _, e := range l.Elements {
			want[e.Set][e.Key.String()] = nftables.Comment(rules[e.Rule])
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
		// The SNAT chains, and no stale one after them; the chains the source map goes to, and
		// none else.
		if len(st.Chains) != 2+len(l.SNAT)+len(l.Sources) {
			t.Errorf("%s: %d chains, want 2, %d SNAT chains and %d source chains", fam, len(st.Chains), len(l.SNAT), len(l.Sources))
		}
		for _, c := range l.SNAT {
			if len(st.Chains[c.Name]) != len(c.Rules) {
				t.Errorf("%s: chain %s holds %d rules, want %d", fam, c.Name, len(st.Chains[c.Name]), len(c.Rules))
			}
		}
		wantCounters := map[string]bool{}
		for _, s := range l.Sources {
			if got := st.Chains[nftables.SourceChainName(s.Name)]; len(got) != len(s.Rules) {
				t.Errorf("%s: source chain of %s holds %d rules, want %d", fam, s.Name, len(got), len(s.Rules))
			}
			wantCounters[s.Name] = s.Outbound >= 0
		}
		if (st.SourceMap != nil) != (len(l.SourceMap) > 0) || len(st.SourceMap) < len(l.SourceMap) {
			t.Errorf("%s: source map of %d elements read back, want %d pieces", fam, len(st.SourceMap), len(l.SourceMap))
		}
		if (st.Outbound != nil) != (l.Outbound >= 0) {
			t.Errorf("%s: outbound counter %v, outbound rule %d", fam, st.Outbound, l.Outbound)
		}
		for name, want := range wantCounters {
			if _, ok := st.SourceOutbound[name]; ok != want {
				t.Errorf("%s: source rule %s's outbound counter there: %v, want %v", fam, name, ok, want)
			}
		}
		if len(st.SourceOutbound) > len(wantCounters) {
			t.Errorf("%s: source outbound counters %v, want those of %v", fam, st.SourceOutbound, wantCounters)
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
		for _, s := range l.Sources {
			if s.Outbound >= 0 && rules[s.Outbound].Address.IsValid() {
				wantSNAT[nftables.SourceCounterName(s.Name)] = rules[s.Outbound].Address
			}
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
	rules, first, outbound := p.Rules(c.Family), 0, l.Outbound
	if c.Set != "" {
		// A source rule's list: none when the rule decides no source of the family.
		i := slices.IndexFunc(l.Sources, func(s nftables.SourceList) bool { return s.Name == c.Set })
		if i < 0 {
			return netip.Addr{}
		}
		s := l.Sources[i]
		rules, first, outbound = p.Sources[s.Index].Policy.Rules(c.Family), s.First, s.Outbound
	}
	read := func(i int) bool { return l.Pieces[first+i] > 0 || first+i == outbound }
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
		for i := range 18 {
			cfg := policytest.Config(r, r.IntN(20))
			if i%4 != 3 {
				cfg = policytest.WithAddresses(r, cfg)
			}
			opts := policy.Options{EnableIPv6: i%3 != 2, RandomFully: true}
			if i%3 != 0 {
				cfg, opts = policytest.WithSourceRules(r, cfg, 5, opts)
			}
			p = policy.Compile(cfg, opts)
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
			MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("10.1.0.0/16"), Address: netip.MustParseAddr("192.0.2.11")}},
			SourceRules: []config.SourceRule{{Name: "batch", CIDRs: []netip.Prefix{pfx("10.244.0.0/16")}, Set: []string{config.KeyNonMasqueradeCIDRs},
				Own: config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("172.16.0.0/12")}}},
				// The longest names and comments: a rule name of config's 40 characters, an IPv6
				// address in a set name, a /128 of eight full groups in a comment.
				{Name: longRule, CIDRs: []netip.Prefix{pfx("fd00::/8")}, Set: []string{config.KeyNonMasqueradeCIDRs, config.KeyMasqueradeCIDRs},
					Own: config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe/128")},
						MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff/128"), Address: netip.MustParseAddr("2001:db8:ffff:ffff:ffff:ffff:ffff:fff1")}}}}}}, true)
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
			{[]string{"flush", "set", "ip", nftables.TableName, "src.batch.return-12"}, []string{datapath.DriftSet}},
			{[]string{"flush", "chain", "ip", nftables.TableName, nftables.SourceChainName("batch")}, []string{datapath.DriftChain}},
			// The source chains are read where the map goes: with its elements gone, so are they.
			{[]string{"flush", "map", "ip", nftables.TableName, nftables.SourceMapName}, []string{datapath.DriftChain, datapath.DriftSet}},
			{[]string{"delete", "element", "ip", nftables.TableName, nftables.SourceMapName, "{ 10.244.0.0/16 }"}, []string{datapath.DriftChain, datapath.DriftSet}},
			{[]string{"add", "element", "ip", nftables.TableName, nftables.SourceMapName, "{ 10.245.0.0/16 : goto " + nftables.SourceChainName("batch") + " }"},
				[]string{datapath.DriftSet}},
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

// longRule is a source rule name as long as the configuration takes.
var longRule = strings.Repeat("long-", 8)[:39] + "x"

// uplink is the address of the veth uplink of TestKernelPacketsDecideFrom, which masquerade
// takes: a probe to it is to a node address, and is left out.
var uplink = map[policy.Family]netip.Prefix{policy.IPv4: pfx("100.64.0.1/32"), policy.IPv6: pfx("fd00:ffff::1/128")}

// sendable tells whether a packet from src to dst can leave by the uplink: both unicast, not
// loopback, not the uplink's address; no IPv6 link-local address (it needs a zone), no IPv4
// "this network" source.
func sendable(src, dst netip.Addr) bool {
	for _, a := range []netip.Addr{src, dst} {
		if a.IsMulticast() || a.IsLoopback() || a.IsUnspecified() || (a.Is6() && (a.IsLinkLocalUnicast() || a.Is4In6())) ||
			a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) || uplink[policy.FamilyOf(a)].Addr() == a {
			return false
		}
	}
	zero := pfx("0.0.0.0/8")
	return !zero.Contains(src) && !zero.Contains(dst)
}

// send sends one UDP packet from src:port to dst, from a socket bound to src whatever the
// node's addresses are (IP_TRANSPARENT).
func send(src, dst netip.Addr, port int) error {
	domain, level, opt := unix.AF_INET6, unix.SOL_IPV6, unix.IPV6_TRANSPARENT
	var from, to unix.Sockaddr = &unix.SockaddrInet6{Port: port, Addr: src.As16()}, &unix.SockaddrInet6{Port: 9, Addr: dst.As16()}
	if src.Is4() {
		domain, level, opt = unix.AF_INET, unix.SOL_IP, unix.IP_TRANSPARENT
		from, to = &unix.SockaddrInet4{Port: port, Addr: src.As4()}, &unix.SockaddrInet4{Port: 9, Addr: dst.As4()}
	}
	fd, err := unix.Socket(domain, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer func() { _ = unix.Close(fd) }() // a datagram socket: nothing to flush
	if err := unix.SetsockoptInt(fd, level, opt, 1); err != nil {
		return fmt.Errorf("transparent: %w", err)
	}
	if err := unix.Bind(fd, from); err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	return unix.Sendto(fd, []byte("probe"), 0, to)
}

// kernelCounts reads the packets of the layout's elements, by set and key, and of the outbound
// counters, by source rule ("" for the global one's).
func kernelCounts(t *testing.T, l *nftables.Layout) (elems map[nftables.Element]uint64, outbound map[string]uint64) {
	t.Helper()
	ctx := context.Background()
	k := nftables.NetlinkKernel{}
	st, err := k.Table(ctx, l.Family, false)
	if err != nil || st == nil {
		t.Fatalf("%s: read the table: %v, %v", l.Family, st, err)
	}
	elems, outbound = map[nftables.Element]uint64{}, map[string]uint64{}
	keys := map[string][]netip.Addr{}
	for _, e := range l.Elements {
		keys[e.Set] = append(keys[e.Set], e.Key)
	}
	for set, ks := range keys {
		got, err := k.Elements(ctx, l.Family, set, ks)
		if err != nil {
			t.Fatal(err)
		}
		for key, e := range got {
			elems[nftables.Element{Set: set, Key: key}] = e.Count.Packets
		}
	}
	if st.Outbound != nil {
		outbound[""] = st.Outbound.Packets
	}
	for rule, c := range st.SourceOutbound {
		outbound[rule] = c.Packets
	}
	return elems, outbound
}

// Packets through the kernel decide as DecideFrom says: in a namespace of its own with a veth
// uplink, for random policies with source rules applied one over the other, a UDP packet of
// each probe leaves by the uplink through the postrouting hook, and the one element or outbound
// counter whose count grows is that of the rule DecideFrom names, in the lists of the source
// rule it names (none grows where no rule decides).
func TestKernelPacketsDecideFrom(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "nft")
	ctx := context.Background()
	ns := testutil.NewNetns(t)
	if err := testutil.IPBatch(ctx, ns, "link set lo up\nlink add up0 type veth peer name up1\nlink set up1 up\nlink set up0 up\naddr add "+uplink[policy.IPv4].String()+
		" dev up0\naddr add "+uplink[policy.IPv6].String()+" dev up0 nodad\nroute add default dev up0\n"); err != nil {
		t.Fatal(err)
	}
	if err := testutil.IPBatch(ctx, ns, "route add default dev up0\n", "-6"); err != nil {
		t.Fatal(err)
	}
	testutil.InNetns(t, ns, func() {
		b, err := nftables.New(ctx, nftables.Options{})
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(40, 3))
		port, sent, bySource := 1024, 0, 0
		for i := range 8 {
			p := drawPolicy(r, 5)
			if err := b.Apply(ctx, p); err != nil {
				t.Fatalf("apply %d: %v", i, err)
			}
			layouts := map[policy.Family]*nftables.Layout{}
			for _, fam := range policy.Families() {
				if p.Enabled(fam) {
					layouts[fam] = nftables.NewLayout(p, fam)
				}
			}
			for _, pr := range probes(r, p, 25) {
				l := layouts[policy.FamilyOf(pr.dst)]
				if l == nil || !sendable(pr.src, pr.dst) {
					continue
				}
				elems, outbound := kernelCounts(t, l)
				port++
				if err := send(pr.src, pr.dst, port); err != nil {
					t.Fatalf("policy %d: %s: %v", i, pr, err)
				}
				sent++
				after, afterOut := kernelCounts(t, l)
				var grew []string
				gotSet, gotRule := "", 0
				rules := l.Rules(p)
				for e, n := range after {
					if n == elems[e] {
						continue
					}
					j := slices.IndexFunc(l.Elements, func(x nftables.Element) bool { return x.Set == e.Set && x.Key == e.Key })
					ri := l.Elements[j].Rule
					gotSet, gotRule = rules[ri].Set, ri+1
					if gotSet != "" {
						gotRule -= l.Sources[slices.IndexFunc(l.Sources, func(s nftables.SourceList) bool { return s.Name == gotSet })].First
					}
					grew = append(grew, fmt.Sprintf("%s %s", e.Set, e.Key))
				}
				for rule, n := range afterOut {
					if n == outbound[rule] {
						continue
					}
					gotSet, gotRule = rule, l.Outbound+1
					if rule != "" {
						s := l.Sources[slices.IndexFunc(l.Sources, func(s nftables.SourceList) bool { return s.Name == rule })]
						gotRule = s.Outbound - s.First + 1
					}
					grew = append(grew, "outbound counter of "+rule)
				}
				want := p.DecideFrom(pr.src, pr.dst)
				// Where no rule decides, nothing counts, in whichever lists.
				if len(grew) > 1 || gotRule != want.Number || (gotRule > 0 && gotSet != sourceRuleName(want)) {
					t.Fatalf("policy %d: %s: counted by %v: rule %d of %q, DecideFrom's rule %d of %q\n%s", i, pr, grew, gotRule, gotSet,
						want.Number, sourceRuleName(want), nft(t, "list", "table", string(map[policy.Family]string{policy.IPv4: "ip", policy.IPv6: "ip6"}[l.Family]), nftables.TableName))
				}
				if want.SourceRule != nil {
					bySource++
				}
			}
		}
		if sent < 200 || bySource < 50 {
			t.Errorf("%d packets sent, %d of them decided by a source rule: too few to tell", sent, bySource)
		}
		t.Logf("%d packets, %d decided by a source rule", sent, bySource)
	})
}
