package nftables_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables/nftablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func compile(cfg config.Config, ipv6 bool) *policy.Policy {
	return policy.Compile(cfg, policy.Options{EnableIPv6: ipv6, RandomFully: true})
}

func newBackend(t *testing.T, f *nftablestest.Fake) *nftables.Backend {
	t.Helper()
	b, err := nftables.New(context.Background(), f.Options())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func apply(t *testing.T, b *nftables.Backend, p *policy.Policy) {
	t.Helper()
	if err := b.Apply(context.Background(), p); err != nil {
		t.Fatal(err)
	}
}

// A rule owns what no earlier rule of its phase holds; a rule inside an earlier one owns
// nothing, and a MASQUERADE rule inside a RETURN one cuts nothing out of it (its phase comes
// first).
func TestLayoutFirstMatch(t *testing.T) {
	cfg := config.Config{
		NonMasqueradeCIDRs: []netip.Prefix{pfx("10.1.0.0/16"), pfx("10.0.0.0/8"), pfx("10.2.0.0/16"), pfx("10.0.0.0/8")},
		MasqueradeCIDRs:    []config.MasqueradeCIDR{{CIDR: pfx("10.3.0.0/24")}},
		MasqOutBound:       true,
	}
	p := compile(cfg, false)
	l := nftables.NewLayout(p, policy.IPv4)
	// masq 10.3.0.0/24; link-local; 10.1/16; 10/8 minus 10.1/16 (8 pieces); 10.2/16 and the
	// second 10/8 own nothing; outbound.
	if want := []int{1, 1, 1, 8, 0, 0, 0}; !slices.Equal(l.Pieces, want) {
		t.Errorf("pieces %v, want %v", l.Pieces, want)
	}
	var sets []string
	for _, s := range l.Sets {
		sets = append(sets, s.Name)
	}
	if want := []string{"masq-24", "return-16", "return-15", "return-14", "return-13", "return-12", "return-11", "return-10", "return-9"}; !slices.Equal(sets, want) {
		t.Errorf("sets %v, want %v", sets, want)
	}
	if want := []string{
		"fib daddr type local return",
		"ip daddr & 255.255.255.0 @masq-24 goto masq",
		"ip daddr & 255.255.0.0 @return-16 return",
	}; !slices.Equal(l.Postrouting[:3], want) {
		t.Errorf("postrouting starts %q, want %q", l.Postrouting[:3], want)
	}
	if got := l.Postrouting[len(l.Postrouting)-1]; got != `counter name "outbound" goto masq` {
		t.Errorf("last rule %q", got)
	}
}

func TestMasqRulesHonourRandomFullyAndToPorts(t *testing.T) {
	p := compile(config.Config{MasqOutBound: true}, false)
	p.ToPorts = policy.PortRanges{{First: 1024, Last: 29999}, {First: 32768, Last: 65535}}
	got := nftables.NewLayout(p, policy.IPv4).Masq
	want := []string{
		"meta l4proto { tcp, udp, sctp } numgen random mod 61744 < 28976 masquerade to :1024-29999 fully-random",
		"meta l4proto { tcp, udp, sctp } masquerade to :32768-65535 fully-random",
		"masquerade fully-random",
	}
	if !slices.Equal(got, want) {
		t.Errorf("masq chain\n%q\nwant\n%q", got, want)
	}
	p.RandomFully, p.ToPorts = false, nil
	if got := nftables.NewLayout(p, policy.IPv4).Masq; !slices.Equal(got, []string{"masquerade"}) {
		t.Errorf("without flags: %q", got)
	}
}

// A masquerade rule with an address has its pieces in sets of that address, which go to a chain
// that SNATs to it with the masquerade chain's ports and flags; the outbound rule goes to its
// family's masquerade address's chain.
func TestSNATLayout(t *testing.T) {
	a := netip.MustParseAddr
	cfg := config.Config{MasqOutBound: true, MasqOutBoundIPv6: true, MasqueradeAddressIPv6: a("2001:db8::11"),
		MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("10.10.0.0/16"), Address: a("192.0.2.12")}, {CIDR: pfx("10.20.0.0/16")},
			{CIDR: pfx("2001:db8:1::/48"), Address: a("2001:db8::12")}}}
	p := compile(cfg, true)
	p.ToPorts = policy.PortRanges{{First: 40000, Last: 40099}}
	l4 := nftables.NewLayout(p, policy.IPv4)
	var sets []string
	for _, s := range l4.Sets {
		sets = append(sets, s.Name)
	}
	if want := []string{"masq-16-192.0.2.12", "masq-16", "return-16"}; !slices.Equal(sets, want) {
		t.Errorf("IPv4 sets %v, want %v", sets, want)
	}
	if want := []string{"fib daddr type local return",
		"ip daddr & 255.255.0.0 @masq-16-192.0.2.12 goto snat-1",
		"ip daddr & 255.255.0.0 @masq-16 goto masq",
		"ip daddr & 255.255.0.0 @return-16 return",
		`counter name "outbound" goto masq`}; !slices.Equal(l4.Postrouting, want) {
		t.Errorf("IPv4 postrouting\n%q\nwant\n%q", l4.Postrouting, want)
	}
	if len(l4.SNAT) != 1 || !slices.Equal(l4.SNAT[0].Rules, []string{
		"meta l4proto { tcp, udp, sctp } snat to 192.0.2.12:40000-40099 fully-random", "snat to 192.0.2.12 fully-random"}) {
		t.Errorf("IPv4 SNAT chains %+v", l4.SNAT)
	}
	l6 := nftables.NewLayout(p, policy.IPv6)
	if got := l6.Postrouting[1]; got != "ip6 daddr & ffff:ffff:ffff:: @masq-48-2001.db8..12 goto snat-1" {
		t.Errorf("IPv6 lookup %q", got)
	}
	if got := l6.Postrouting[len(l6.Postrouting)-1]; got != `counter name "outbound" goto snat-2` {
		t.Errorf("IPv6 outbound %q, want the chain of masqueradeAddressIPv6", got)
	}
	if len(l6.SNAT) != 2 || l6.SNAT[1].Address != a("2001:db8::11") || !slices.Equal(l6.SNAT[1].Rules, []string{
		"meta l4proto { tcp, udp, sctp } snat to [2001:db8::11]:40000-40099 fully-random", "snat to 2001:db8::11 fully-random"}) {
		t.Errorf("IPv6 SNAT chains %+v", l6.SNAT)
	}
}

// destinations are addresses where the order matters, for both families.
func destinations(r *rand.Rand, p *policy.Policy) []netip.Addr {
	var out []netip.Addr
	for _, fam := range policy.Families() {
		for range 30 {
			out = append(out, policytest.Destination(r, p, fam))
		}
	}
	return out
}

// The rules the backend installs, run by the tracer over knftables' fake, decide as Decide
// does, for random configurations applied one after the other (each an update of the last), and
// the element that counts the packet belongs to the rule Decide names. After each update, the
// table equals the one a fresh backend installs from nothing.
func TestTracedRulesEqualDecide(t *testing.T) {
	r := rand.New(rand.NewPCG(15, 1))
	f := nftablestest.New()
	b := newBackend(t, f)
	for iter := range 200 {
		cfg := policytest.Config(r, r.IntN(20))
		if r.IntN(2) == 0 {
			cfg = policytest.WithAddresses(r, cfg)
		}
		p := compile(cfg, r.IntN(4) > 0)
		apply(t, b, p)
		layouts := map[policy.Family]*nftables.Layout{}
		for _, fam := range policy.Families() {
			if p.Enabled(fam) {
				layouts[fam] = nftables.NewLayout(p, fam)
			}
		}
		for _, dst := range destinations(r, p) {
			want := p.Decide(dst)
			got, err := f.Trace(dst, false)
			if err != nil {
				t.Fatal(err)
			}
			if got.Action != want.Action {
				t.Fatalf("iteration %d: %s: traced %s, Decide %s (rule %d)\n%s", iter, dst, got.Action, want.Action, want.Number, f.Dump(policy.FamilyOf(dst)))
			}
			if want.Rule != nil && want.Action == policy.Masquerade && got.Source != want.Rule.Address {
				t.Fatalf("iteration %d: %s: traced to the source %v, Decide's rule %d to %v\n%s", iter, dst, got.Source,
					want.Number, want.Rule.Address, f.Dump(policy.FamilyOf(dst)))
			}
			if !p.Enabled(policy.FamilyOf(dst)) {
				continue
			}
			rule := counted(t, layouts[policy.FamilyOf(dst)], got)
			if rule != want.Number {
				t.Fatalf("iteration %d: %s: counted by rule %d, Decide's rule %d", iter, dst, rule, want.Number)
			}
			if local, _ := f.Trace(dst, true); local.Action != policy.Return || local.Set != "" || local.Outbound {
				t.Fatalf("%s as a node address: %+v", dst, local)
			}
		}
		fresh := nftablestest.New()
		apply(t, newBackend(t, fresh), p)
		for _, fam := range policy.Families() {
			if got, want := sortedDump(f.Dump(fam)), sortedDump(fresh.Dump(fam)); got != want {
				t.Fatalf("iteration %d: %s: updated table\n%s\ndiffers from a fresh one\n%s", iter, fam, got, want)
			}
		}
	}
}

// Every state an apply passes through (each transaction or element batch committed) decides
// every destination of the family it changed as the old policy does, or every one as the new
// policy does, never some as one and some as the other: for random configurations applied one
// after the other, starting from no table; and the elements go in batches.
func TestApplyStepsDecideAsOldOrNew(t *testing.T) {
	r := rand.New(rand.NewPCG(16, 1))
	f := nftablestest.New()
	b := newBackend(t, f)
	var old, next *policy.Policy // old nil: no table, nothing masqueraded
	var dsts []netip.Addr
	decides := func(p *policy.Policy, dst netip.Addr, got nftablestest.Verdict) bool {
		if p == nil || !p.Enabled(policy.FamilyOf(dst)) {
			return got.Action == policy.Return
		}
		want := p.Decide(dst)
		return got.Action == want.Action && (want.Action != policy.Masquerade || want.Rule == nil || got.Source == want.Rule.Address)
	}
	states := 0
	f.Committed = func(fam policy.Family) {
		states++
		asOld, asNew := true, true
		var first []string
		for _, dst := range dsts {
			if policy.FamilyOf(dst) != fam {
				continue
			}
			got, err := f.Trace(dst, false)
			if err != nil {
				t.Fatal(err)
			}
			o, n := decides(old, dst, got), decides(next, dst, got)
			asOld, asNew = asOld && o, asNew && n
			if !o || !n {
				first = append(first, fmt.Sprintf("%s: %s to %v (as old: %v, as new: %v)", dst, got.Action, got.Source, o, n))
			}
		}
		if !asOld && !asNew {
			t.Fatalf("a state decides neither as the old policy nor as the new:\n%s\n%s", strings.Join(first, "\n"), f.Dump(fam))
		}
	}
	for range 200 {
		cfg := policytest.Config(r, r.IntN(20))
		if r.IntN(2) == 0 {
			cfg = policytest.WithAddresses(r, cfg)
		}
		if r.IntN(4) == 0 {
			cfg.MasqOutBound, cfg.MasqOutBoundIPv6 = !cfg.MasqOutBound, !cfg.MasqOutBoundIPv6
		}
		next = compile(cfg, r.IntN(4) > 0)
		dsts = destinations(r, next)
		if old != nil {
			dsts = append(dsts, destinations(r, old)...)
		}
		apply(t, b, next)
		old = next
	}
	if f.Batches[policy.IPv4] < 150 {
		t.Errorf("%d element batches for 200 applies", f.Batches[policy.IPv4])
	}
	t.Logf("%d states checked; %d IPv4 transactions, %d batches", states, f.Runs[policy.IPv4], f.Batches[policy.IPv4])
}

// counted is the number of the rule whose counter a traced packet went to (0: none).
func counted(t *testing.T, l *nftables.Layout, v nftablestest.Verdict) int {
	t.Helper()
	switch {
	case v.Outbound:
		return l.Outbound + 1
	case v.Set == "":
		return 0
	}
	for _, e := range l.Elements {
		if e.Set == v.Set && e.Key == v.Key {
			return e.Rule + 1
		}
	}
	t.Fatalf("traced element %s %s is not in the layout", v.Set, v.Key)
	return 0
}

// sortedDump is a dump with its lines sorted: element and set order does not matter.
func sortedDump(s string) string {
	lines := strings.Split(s, "\n")
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func hit(t *testing.T, f *nftablestest.Fake, dst string, n int) {
	t.Helper()
	for range n {
		if _, err := f.Trace(netip.MustParseAddr(dst), false); err != nil {
			t.Fatal(err)
		}
	}
}

func packets(cs []datapath.RuleCounter) map[string]uint64 {
	out := map[string]uint64{}
	for _, c := range cs {
		out[c.Source()+" "+c.Prefix.String()] = c.Packets
	}
	return out
}

// Counters sum a rule's elements; a rule whose elements stay across an update keeps its
// counts, even when it moves in the list; a new rule starts at zero, and so does a rule whose
// pieces changed (an earlier rule that overlaps it came or went).
func TestCountersKeptAcrossUpdates(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	b := newBackend(t, f)
	if cs, err := b.Counters(ctx); err != nil || len(cs) != 0 {
		t.Fatalf("before the first apply: %v, %v", cs, err)
	}
	cfg := config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.1.0.0/16"), pfx("10.0.0.0/8"), pfx("172.16.0.0/12")},
		MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("172.16.1.0/24")}}, MasqOutBound: true}
	apply(t, b, compile(cfg, false))
	hit(t, f, "10.1.2.3", 2)
	hit(t, f, "10.200.0.1", 3) // a piece of 10/8 other than the first
	hit(t, f, "10.0.0.1", 1)
	hit(t, f, "172.17.0.1", 6)
	hit(t, f, "172.16.1.1", 7)
	hit(t, f, "8.8.8.8", 5)
	cs, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]uint64{"masqueradeCIDRs[0] 172.16.1.0/24": 7, "link-local 169.254.0.0/16": 0, "nonMasqueradeCIDRs[0] 10.1.0.0/16": 2,
		"nonMasqueradeCIDRs[1] 10.0.0.0/8": 4, "nonMasqueradeCIDRs[2] 172.16.0.0/12": 6, "outbound 0.0.0.0/0": 5}
	if got := packets(cs); !mapsEqual(got, want) {
		t.Errorf("counters %v, want %v", got, want)
	}
	// All move; 192.168/16 is new; 10/8's pieces stay (10.1/16 still comes first).
	cfg.NonMasqueradeCIDRs = []netip.Prefix{pfx("192.168.0.0/16"), pfx("172.16.0.0/12"), pfx("10.1.0.0/16"), pfx("10.0.0.0/8")}
	cfg.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: pfx("1.2.3.4/32")}, {CIDR: pfx("172.16.1.0/24")}}
	apply(t, b, compile(cfg, false))
	cs, err = b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want = map[string]uint64{"masqueradeCIDRs[0] 1.2.3.4/32": 0, "masqueradeCIDRs[1] 172.16.1.0/24": 7, "link-local 169.254.0.0/16": 0,
		"nonMasqueradeCIDRs[0] 192.168.0.0/16": 0, "nonMasqueradeCIDRs[1] 172.16.0.0/12": 6, "nonMasqueradeCIDRs[2] 10.1.0.0/16": 2,
		"nonMasqueradeCIDRs[3] 10.0.0.0/8": 4, "outbound 0.0.0.0/0": 5}
	if got := packets(cs); !mapsEqual(got, want) {
		t.Errorf("after a reorder: counters %v, want %v", got, want)
	}
	// 10/8 before 10.1/16 now: 10/8 is one element (its count starts over), 10.1/16 none.
	cfg.NonMasqueradeCIDRs = []netip.Prefix{pfx("10.0.0.0/8"), pfx("10.1.0.0/16")}
	apply(t, b, compile(cfg, false))
	hit(t, f, "10.1.2.3", 1)
	cs, err = b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want = map[string]uint64{"masqueradeCIDRs[0] 1.2.3.4/32": 0, "masqueradeCIDRs[1] 172.16.1.0/24": 7, "link-local 169.254.0.0/16": 0,
		"nonMasqueradeCIDRs[0] 10.0.0.0/8": 1, "nonMasqueradeCIDRs[1] 10.1.0.0/16": 0, "outbound 0.0.0.0/0": 5}
	if got := packets(cs); !mapsEqual(got, want) {
		t.Errorf("after 10/8 took over 10.1/16: counters %v, want %v", got, want)
	}
}

func mapsEqual(a, b map[string]uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// An unchanged policy applied again runs no transaction while nothing changed the ruleset; a
// restarted backend reads the table back and changes no element (the counts stay).
func TestApplyAgainChangesNothing(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	p := compile(config.Default(config.Options{}), true)
	b := newBackend(t, f)
	apply(t, b, p)
	hit(t, f, "10.9.9.9", 3)
	runs := f.Runs[policy.IPv4]
	apply(t, b, p)
	if f.Runs[policy.IPv4] != runs {
		t.Errorf("the same policy again ran %d transactions", f.Runs[policy.IPv4]-runs)
	}
	for _, b := range []*nftables.Backend{b, newBackend(t, f)} {
		apply(t, b, p)
		apply(t, b, p)
		cs, err := b.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := packets(cs)["nonMasqueradeCIDRs[0] 10.0.0.0/8"]; got != 3 {
			t.Errorf("10/8 counts %d after applying again, want 3", got)
		}
	}
}

// A scrape reads the layout's elements by key, never a set whole (a walk takes time quadratic
// in the elements: 40 s for a 100k-element set here); so does an apply after another owner
// changed the ruleset (as kube-proxy's nftables mode does all the time) while the agent's table
// is as it left it. An element added behind the agent's back is the drift check's walk to
// find; the apply after it reads the sets whole and removes it.
func TestElementsReadByKey(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	b := newBackend(t, f)
	p := compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.0.0.0/8"), pfx("172.16.0.0/12")}, MasqOutBound: true}, false)
	apply(t, b, p)
	hit(t, f, "10.1.2.3", 2)
	walks, reads := f.Walks, f.ElementReads
	cs, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := packets(cs)["nonMasqueradeCIDRs[0] 10.0.0.0/8"]; got != 2 {
		t.Errorf("10/8 counts %d, want 2", got)
	}
	if f.Walks != walks || f.ElementReads == reads {
		t.Errorf("the scrape walked %d sets whole and read %d elements by key", f.Walks-walks, f.ElementReads-reads)
	}
	// Another owner's transaction (here one that changes nothing): a new generation.
	if err := f.Run(ctx, policy.IPv4, func(tx *knftables.Transaction) { tx.Add(&knftables.Table{}) }); err != nil {
		t.Fatal(err)
	}
	walks, reads = f.Walks, f.ElementReads
	apply(t, b, p)
	if f.Walks != walks || f.ElementReads == reads {
		t.Errorf("the apply after another owner's change walked %d sets whole and read %d elements by key", f.Walks-walks, f.ElementReads-reads)
	}
	if err := f.Run(ctx, policy.IPv4, func(tx *knftables.Transaction) {
		tx.Add(&knftables.Element{Set: "return-8", Key: []string{"11.0.0.0"}})
	}); err != nil {
		t.Fatal(err)
	}
	if kinds, err := b.CheckDrift(ctx); err != nil || !slices.Equal(kinds, []string{datapath.DriftSet}) {
		t.Fatalf("drift %v, %v", kinds, err)
	}
	apply(t, b, p)
	if v, _ := f.Trace(netip.MustParseAddr("11.0.0.1"), false); v.Action != policy.Masquerade {
		t.Errorf("the element added behind the agent's back stays: %+v", v)
	}
}

// A walk that misses elements (a walk of a set the kernel is resizing does, right after an
// apply of thousands) is not drift, and costs no counter: what it misses is looked up by key.
// An element that is gone is drift.
func TestWalkMissesAreLookedUp(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	b := newBackend(t, f)
	// 10/8 is 10.0.0.0/16 (the lowest key of return-16) and 7 more pieces.
	p := compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.1.0.0/16"), pfx("10.0.0.0/8")}, MasqOutBound: true}, false)
	apply(t, b, p)
	hit(t, f, "10.0.0.1", 3)
	f.WalkMisses = 1
	// A foreign change: the check walks the sets.
	if err := f.Run(ctx, policy.IPv4, func(tx *knftables.Transaction) { tx.Add(&knftables.Table{}) }); err != nil {
		t.Fatal(err)
	}
	if kinds, err := b.CheckDrift(ctx); err != nil || len(kinds) != 0 {
		t.Errorf("a walk that missed an element: drift %v, %v", kinds, err)
	}
	in, err := nftables.Inspect(ctx, f.Kernel(), p)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := in.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := packets(cs)["nonMasqueradeCIDRs[1] 10.0.0.0/8"]; got != 3 {
		t.Errorf("dump: 10/8 counts %d after a walk that missed an element, want 3", got)
	}
	if err := f.Run(ctx, policy.IPv4, func(tx *knftables.Transaction) {
		tx.Delete(&knftables.Element{Set: "return-16", Key: []string{"10.1.0.0"}})
	}); err != nil {
		t.Fatal(err)
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
	if !slices.Equal(kinds, []string{datapath.DriftSet}) {
		t.Errorf("an element gone: drift %v", kinds)
	}
}

// Drift: each damage is found (and only its kind), the next Apply repairs it, and the check
// after finds nothing. An unchanged generation is no drift at all.
func TestDriftFoundAndRepaired(t *testing.T) {
	ctx := context.Background()
	p := compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.0.0.0/8")}, MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: pfx("10.1.0.0/16")}},
		MasqOutBound: true}, false)
	for _, d := range []struct {
		name string
		what []string
		do   func(tx *knftables.Transaction)
	}{
		{"table deleted", []string{datapath.DriftTable}, func(tx *knftables.Transaction) { tx.Delete(&knftables.Table{}) }},
		{"set flushed", []string{datapath.DriftSet}, func(tx *knftables.Transaction) { tx.Flush(&knftables.Set{Name: "return-8"}) }},
		{"element added", []string{datapath.DriftSet}, func(tx *knftables.Transaction) {
			tx.Add(&knftables.Element{Set: "return-8", Key: []string{"11.0.0.0"}})
		}},
		{"chain changed", []string{datapath.DriftChain}, func(tx *knftables.Transaction) {
			tx.Insert(&knftables.Rule{Chain: nftables.ChainPostrouting, Rule: "return"})
		}},
		{"set added", []string{datapath.DriftSet}, func(tx *knftables.Transaction) {
			tx.Add(&knftables.Set{Name: "masq-32", Type: "ipv4_addr"})
		}},
	} {
		t.Run(d.name, func(t *testing.T) {
			f := nftablestest.New()
			b := newBackend(t, f)
			apply(t, b, p)
			if kinds, err := b.CheckDrift(ctx); err != nil || len(kinds) != 0 {
				t.Fatalf("right after the apply: %v, %v", kinds, err)
			}
			if err := f.Run(ctx, policy.IPv4, d.do); err != nil {
				t.Fatal(err)
			}
			kinds, err := b.CheckDrift(ctx)
			if err != nil || !slices.Equal(kinds, d.what) {
				t.Fatalf("drift %v, %v; want %v", kinds, err, d.what)
			}
			apply(t, b, p)
			if kinds, err := b.CheckDrift(ctx); err != nil || len(kinds) != 0 {
				t.Fatalf("after the repair: %v, %v\n%s", kinds, err, f.Dump(policy.IPv4))
			}
			fresh := nftablestest.New()
			apply(t, newBackend(t, fresh), p)
			if got, want := sortedDump(f.Dump(policy.IPv4)), sortedDump(fresh.Dump(policy.IPv4)); got != want {
				t.Errorf("repaired table\n%s\ndiffers from a fresh one\n%s", got, want)
			}
		})
	}
}

// A transaction the kernel refuses fails the apply; the next one replaces what it cannot
// update.
func TestApplyErrors(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	b := newBackend(t, f)
	f.Fail = errors.New("no space left")
	if err := b.Apply(ctx, compile(config.Default(config.Options{}), false)); err == nil || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("err = %v", err)
	}
	f.Fail = nil
	apply(t, b, compile(config.Default(config.Options{}), false))
	if v, _ := f.Trace(netip.MustParseAddr("10.1.1.1"), false); v.Action != policy.Return || v.Set != "return-8" {
		t.Errorf("after the failure: %+v", v)
	}
}

// IPv6 disabled: the first apply removes an IPv6 table an earlier run left; Cleanup removes
// both tables, twice.
func TestStaleIPv6AndCleanup(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	apply(t, newBackend(t, f), compile(config.Default(config.Options{}), true))
	if f.Table(policy.IPv6) == nil {
		t.Fatal("no IPv6 table")
	}
	b := newBackend(t, f)
	apply(t, b, compile(config.Default(config.Options{}), false))
	if f.Table(policy.IPv6) != nil {
		t.Error("the stale IPv6 table stays")
	}
	for range 2 {
		if err := b.Cleanup(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if f.Table(policy.IPv4) != nil || f.Table(policy.IPv6) != nil {
		t.Error("cleanup left a table")
	}
	if cs, err := b.Counters(ctx); err != nil || len(cs) != 0 {
		t.Errorf("counters after cleanup: %v, %v", cs, err)
	}
}

// Inspect reads the tables of another process: with the policy, as the backend's counters,
// then what the policy does not explain; without it, every group of elements by comment.
func TestInspect(t *testing.T) {
	ctx := context.Background()
	f := nftablestest.New()
	if in, err := nftables.Inspect(ctx, f.Kernel(), nil); err != nil || in != nil {
		t.Fatalf("nothing installed: %v, %v", in, err)
	}
	installed := compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.0.0.0/8"), pfx("172.16.0.0/12")}, MasqOutBound: true}, false)
	apply(t, newBackend(t, f), installed)
	hit(t, f, "172.16.0.9", 2)
	hit(t, f, "1.1.1.1", 1)
	expected := compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{pfx("10.0.0.0/8")}, MasqOutBound: true}, false)
	in, err := nftables.Inspect(ctx, f.Kernel(), expected)
	if err != nil || in == nil {
		t.Fatalf("inspect: %v, %v", in, err)
	}
	if got := in.Info(); got.Backend != nftables.Name || got.Details != "table ip ip-masq-agent" {
		t.Errorf("info %+v", got)
	}
	cs, err := in.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range cs {
		got = append(got, strings.Join([]string{c.Source(), c.Prefix.String(), c.Action.String()}, " "), "")
		got[len(got)-1] = string(rune('0' + c.Rule))
	}
	want := []string{"link-local 169.254.0.0/16 RETURN", "1", "nonMasqueradeCIDRs[0] 10.0.0.0/8 RETURN", "2",
		"outbound 0.0.0.0/0 MASQUERADE", "3", "nonMasqueradeCIDRs 172.16.0.0/12 RETURN", "0"}
	if !slices.Equal(got, want) {
		t.Errorf("counters %q, want %q", got, want)
	}
	if c := cs[3]; c.Packets != 2 || c.Rule != 0 {
		t.Errorf("the unexplained rule: %+v", c)
	}
}

// dump's counters carry each masquerade rule's address, as the fake's chains SNAT it: random
// policies with masquerade addresses, with and without the policy given.
func TestInspectAddresses(t *testing.T) {
	f := nftablestest.New()
	b := newBackend(t, f)
	r := rand.New(rand.NewPCG(16, 4))
	addressed := 0
	for i := range 8 {
		p := compile(policytest.WithAddresses(r, policytest.Config(r, r.IntN(20))), i%2 == 0)
		apply(t, b, p)
		addressed += checkDumpAddresses(t, f.Kernel(), p)
	}
	if addressed == 0 {
		t.Fatal("no counter carried an address: the policies exercised nothing")
	}
}

// render prints the transaction that installs the table from nothing: the seeds' default
// policy, IPv4 only without --enable-ipv6.
func TestRenderAll(t *testing.T) {
	p := compile(config.Default(config.Options{}), false)
	got := nftables.RenderAll(p)
	for _, want := range []string{
		"# nft -f -\n",
		"add table ip ip-masq-agent { comment \"ip-masq-agent: masquerade policy; changes behind the agent's back are repaired\" ; }\n",
		"add chain ip ip-masq-agent postrouting { type nat hook postrouting priority 100 ; }\n",
		"add set ip ip-masq-agent return-8 { type ipv4_addr ; counter ; }\n",
		"add rule ip ip-masq-agent postrouting fib daddr type local return\n",
		"add rule ip ip-masq-agent postrouting ip daddr & 255.0.0.0 @return-8 return\n",
		"add rule ip ip-masq-agent postrouting counter name \"outbound\" goto masq\n",
		"add rule ip ip-masq-agent masq masquerade fully-random\n",
		"add element ip ip-masq-agent return-8 { 10.0.0.0 comment \"nonMasqueradeCIDRs 10.0.0.0/8\" }\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("render lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, " ip6 ") {
		t.Errorf("IPv6 rendered without --enable-ipv6:\n%s", got)
	}
}
