package metrics

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// manyRules is a policy of n non-masquerade CIDRs (10.x.y.0/24) and the outbound rule, as a
// backend counts them: rule i matched packets[i] packets (zero beyond the slice).
func manyRules(n int, packets map[int]uint64) []datapath.RuleCounter {
	out := make([]datapath.RuleCounter, 0, n+1)
	for i := range n {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24)
		out = append(out, datapath.RuleCounter{Family: policy.IPv4, Rule: i + 1, Prefix: p, Action: policy.Return,
			Origin: policy.OriginNonMasqueradeCIDRs, Entry: i, Packets: packets[i], Bytes: 100 * packets[i]})
	}
	return append(out, datapath.RuleCounter{Family: policy.IPv4, Rule: n + 1, Prefix: netip.MustParsePrefix("0.0.0.0/0"),
		Action: policy.Masquerade, Origin: policy.OriginOutbound, Entry: -1, Packets: packets[n], Bytes: 100 * packets[n]})
}

// shownCIDRs scrapes the collector and returns the CIDRs that have a packets series, and the
// packets total of the nonMasqueradeCIDRs origin.
func shownCIDRs(t *testing.T, c *Collector) ([]string, float64) {
	t.Helper()
	fams := scrape(t, newRegistryOf(t, c))
	var out []string
	for _, m := range fams[RulePackets].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "cidr" {
				out = append(out, l.GetValue())
			}
		}
	}
	var total float64
	for _, m := range fams[OriginPackets].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "origin" && l.GetValue() == string(policy.OriginNonMasqueradeCIDRs) {
				total = m.GetCounter().GetValue()
			}
		}
	}
	slices.Sort(out)
	return out, total
}

func cidrOf(i int) string {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24).String()
}

func cidrsOf(is ...int) []string {
	out := make([]string, len(is))
	for j, i := range is {
		out[j] = cidrOf(i)
	}
	slices.Sort(out)
	return out
}

// A policy of more rules than the limit exports the busiest rules only, the first in policy order
// among equals; the per-origin totals count every rule.
func TestRuleSeriesBounded(t *testing.T) {
	b := &datapathtest.Backend{RuleCounters: manyRules(10_000, map[int]uint64{7: 50, 9_000: 900, 10_000: 5})}
	c := NewCollector(Options{Backend: b, RuleSeries: 4})
	if n := testutil.CollectAndCount(c, RulePackets, RuleBytes); n != 8 {
		t.Errorf("%d per-rule series, want 2 for each of the 4 rules", n)
	}
	got, total := shownCIDRs(t, c)
	// The outbound rule (5 packets) and the two busy CIDRs, then the first idle one.
	want := append(cidrsOf(0, 7, 9_000), "0.0.0.0/0")
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("series for %q, want %q", got, want)
	}
	if total != 950 {
		t.Errorf("nonMasqueradeCIDRs total %v, want 950", total)
	}
	// Every rule: the full table.
	c = NewCollector(Options{Backend: b, RuleSeries: -1})
	if n := testutil.CollectAndCount(c, RulePackets); n != 10_001 {
		t.Errorf("%d packets series with every rule exported, want 10001", n)
	}
}

// A rule keeps its series until another has twice its packets, so that rules of about the same
// traffic do not swap series at every scrape; a rule that goes away leaves its place to the next.
func TestRuleSeriesSticky(t *testing.T) {
	counts := map[int]uint64{1: 10, 2: 10, 3: 9}
	b := &datapathtest.Backend{RuleCounters: manyRules(100, counts)}
	c := NewCollector(Options{Backend: b, RuleSeries: 2})
	step := func(what string, want []string) {
		t.Helper()
		b.SetRuleCounters(manyRules(100, counts))
		if got, _ := shownCIDRs(t, c); !slices.Equal(got, want) {
			t.Errorf("%s: series for %q, want %q", what, got, want)
		}
	}
	step("first scrape", cidrsOf(1, 2))
	counts[3] = 19 // busier than 2, not twice as busy
	step("rule 3 busier", cidrsOf(1, 2))
	counts[3] = 21
	step("rule 3 twice as busy as rule 2", cidrsOf(1, 3))
	counts[2] = 100 // busier than both now
	step("rule 2 ten times as busy", cidrsOf(2, 3))
	delete(counts, 3)
	b.SetRuleCounters(slices.DeleteFunc(manyRules(100, counts), func(r datapath.RuleCounter) bool {
		return r.Prefix.String() == cidrOf(3)
	}))
	if got, _ := shownCIDRs(t, c); !slices.Equal(got, cidrsOf(1, 2)) {
		t.Errorf("rule 3 removed: series for %q, want %q", got, cidrsOf(1, 2))
	}
}

// The per-origin totals never go down: a removed rule's packets stay in its origin's total, and a
// rule that comes back counts from zero on top of it.
func TestOriginTotalsKeepRemovedRules(t *testing.T) {
	counts := map[int]uint64{0: 100, 1: 40}
	b := &datapathtest.Backend{RuleCounters: manyRules(2, counts)}
	c := NewCollector(Options{Backend: b})
	total := func(what string, want float64) {
		t.Helper()
		if _, got := shownCIDRs(t, c); got != want {
			t.Errorf("%s: nonMasqueradeCIDRs total %v, want %v", what, got, want)
		}
	}
	total("two rules", 140)
	b.SetRuleCounters(manyRules(1, map[int]uint64{0: 120})) // rule 1 removed
	total("rule 1 removed", 160)
	b.SetRuleCounters(manyRules(2, map[int]uint64{0: 130, 1: 3})) // rule 1 back, from zero
	total("rule 1 back", 173)
}

// newRegistryOf is a registry of c alone.
func newRegistryOf(t *testing.T, c *Collector) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	return reg
}

// A source rule's rules are series of their own, told apart from the global lists' by an origin
// that names the rule, even where the two hold the same CIDR: one origin value per source rule
// and origin, however many pods the rule selects.
func TestSourceRuleSeries(t *testing.T) {
	rules := manyRules(1, map[int]uint64{0: 4, 1: 6})
	for _, r := range manyRules(1, map[int]uint64{0: 1, 1: 2}) {
		r.Set = "batch"
		rules = append(rules, r)
	}
	c := NewCollector(Options{Backend: &datapathtest.Backend{RuleCounters: rules}})
	fams := scrape(t, newRegistryOf(t, c))
	got := map[string]float64{}
	for _, m := range fams[OriginPackets].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "origin" {
				got[l.GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	want := map[string]float64{"nonMasqueradeCIDRs": 4, "outbound": 6,
		"sourceRules[batch].nonMasqueradeCIDRs": 1, "sourceRules[batch].outbound": 2}
	if len(got) != len(want) {
		t.Errorf("origin totals %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("origin %s: %v packets, want %v (all: %v)", k, got[k], v, got)
		}
	}
	if n := testutil.CollectAndCount(c, RulePackets); n != 4 {
		t.Errorf("%d rule series, want 4: the same CIDR in two lists is two rules", n)
	}
}

// The time each change of the selected pods took to reach the datapath is a histogram of the
// agent's Observer.
func TestSourcePodsApply(t *testing.T) {
	obs := NewObserver()
	obs.ObservePodsApplied(time.Second / 256)
	obs.ObservePodsApplied(time.Second / 32)
	fams := scrape(t, newRegistryOf(t, NewCollector(Options{Backend: &datapathtest.Backend{}, Observer: obs})))
	h := fams[SourcePodsApply].GetMetric()
	if len(h) != 1 || h[0].GetHistogram().GetSampleCount() != 2 || h[0].GetHistogram().GetSampleSum() != 0.03515625 || h[0].GetHistogram().GetBucket()[2].GetCumulativeCount() != 1 {
		t.Errorf("%s: %v, want 2 samples of 1/256 s (le=0.005) and 1/32 s", SourcePodsApply, h)
	}
}
