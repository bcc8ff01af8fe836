package metrics

import (
	"hash/maphash"
	"net/netip"
	"slices"
	"sync"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// DefaultRuleSeries is how many rules have series of their own by default (Options.RuleSeries):
// a policy of more rules exports the busiest ones, so that a node's series stay bounded whatever
// the number of CIDRs (two per rule would be 20,000 at 10k CIDRs).
const DefaultRuleSeries = 32

// displaceFactor is how many times the packets of the least busy rule with a series another rule
// must have to take its place: without the margin, two rules of about the same traffic would
// swap their series at every scrape.
const displaceFactor = 2

// ruleID identifies a rule across scrapes: what its series' labels say.
type ruleID struct {
	set    string
	family policy.Family
	prefix netip.Prefix
	action policy.Action
	origin policy.Origin
}

// originID identifies a series of the per-origin totals.
type originID struct {
	set    string
	family policy.Family
	action policy.Action
	origin policy.Origin
}

type counts struct{ packets, bytes uint64 }

func (c *counts) add(o counts) { c.packets += o.packets; c.bytes += o.bytes }

// seen is what the table remembers of a rule's last scrape.
type seen struct {
	counts
	origin originID
}

// ruleTable is what the collector keeps between scrapes for the per-rule metrics: which rules
// have series of their own, and the counts of every rule, so that the per-origin totals never
// go down when a configuration change removes a rule (Prometheus would read that as a reset and
// count the whole total again).
type ruleTable struct {
	limit int // Options.RuleSeries

	mu   sync.Mutex
	seed maphash.Seed
	// shown are the rules with series of their own at the last scrape (when limited).
	shown map[ruleID]bool
	// last holds every rule's counts at the last scrape, by the hash of its ruleID: 40 bytes a
	// rule rather than 100, for policies of 100k rules.
	last map[uint64]seen
	// removed adds up, by origin, the last counts of the rules that went away.
	removed map[originID]counts
}

func newRuleTable(limit int) *ruleTable {
	return &ruleTable{limit: limit, seed: maphash.MakeSeed(), shown: map[ruleID]bool{}, last: map[uint64]seen{},
		removed: map[originID]counts{}}
}

// ruleScrape is what one scrape exports of the rules.
type ruleScrape struct {
	// rules are the rules with series of their own, in policy order.
	rules []datapath.RuleCounter
	// origins are the per-origin totals of every rule, removed ones included, in policy order
	// of their first rule.
	origins []originTotal
	// perFamily counts the rules in force by family.
	perFamily map[policy.Family]int
}

type originTotal struct {
	originID
	counts
}

// scrape takes the backend's counters of one scrape. Counters without an origin are not rules
// of the policy; identical rules (the same labels) would be one series twice, and only the first
// can match (first match wins), so it stands for both.
func (t *ruleTable) scrape(all []datapath.RuleCounter) ruleScrape {
	out := ruleScrape{perFamily: map[policy.Family]int{}}
	rules := make([]datapath.RuleCounter, 0, len(all))
	ids := make([]ruleID, 0, len(all))
	dup := make(map[ruleID]bool, len(all))
	for _, r := range all {
		id := ruleID{r.Set, r.Family, r.Prefix, r.Action, r.Origin}
		if r.Origin == "" || dup[id] {
			continue
		}
		dup[id] = true
		rules, ids = append(rules, r), append(ids, id)
		out.perFamily[r.Family]++
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	out.origins = t.totals(rules, ids)
	if t.limit <= 0 || len(rules) <= t.limit {
		clear(t.shown)
		out.rules = rules
		return out
	}
	for _, i := range t.choose(rules, ids) {
		out.rules = append(out.rules, rules[i])
	}
	return out
}

// totals returns the per-origin totals and remembers this scrape's counts.
func (t *ruleTable) totals(rules []datapath.RuleCounter, ids []ruleID) []originTotal {
	now := make(map[uint64]seen, len(rules))
	var out []originTotal
	index := map[originID]int{}
	for i, r := range rules {
		o := originID{r.Set, r.Family, r.Action, r.Origin}
		c := counts{r.Packets, r.Bytes}
		now[maphash.Comparable(t.seed, ids[i])] = seen{c, o}
		j, ok := index[o]
		if !ok {
			j = len(out)
			index[o] = j
			out = append(out, originTotal{originID: o})
		}
		out[j].add(c)
	}
	for h, s := range t.last {
		if _, ok := now[h]; !ok {
			c := t.removed[s.origin]
			c.add(s.counts)
			t.removed[s.origin] = c
		}
	}
	t.last = now
	for i := range out {
		out[i].add(t.removed[out[i].originID])
	}
	return out
}

// choose returns the indexes, in policy order, of the limit rules that keep series of their own:
// those that had one at the last scrape, while no other rule has displaceFactor times their
// packets, and the busiest of the others (the first in policy order among equals) for the
// places left.
func (t *ruleTable) choose(rules []datapath.RuleCounter, ids []ruleID) []int {
	// rank orders the rules from the busiest down.
	rank := make([]int, len(rules))
	for i := range rank {
		rank[i] = i
	}
	slices.SortStableFunc(rank, func(a, b int) int {
		pa, pb := rules[a].Packets, rules[b].Packets
		switch {
		case pa > pb:
			return -1
		case pa < pb:
			return 1
		}
		return 0
	})
	in := make([]bool, len(rules))
	n := 0
	for _, i := range rank {
		if n < t.limit && t.shown[ids[i]] {
			in[i], n = true, n+1
		}
	}
	for _, i := range rank {
		if n < t.limit && !in[i] {
			in[i], n = true, n+1
		}
	}
	// The busiest rule without a series displaces the least busy with one, while it has
	// displaceFactor times its packets.
	hi, lo := 0, len(rank)-1
	for {
		for hi < len(rank) && in[rank[hi]] {
			hi++
		}
		for lo >= 0 && !in[rank[lo]] {
			lo--
		}
		if hi >= len(rank) || lo < 0 || hi > lo || rules[rank[hi]].Packets <= displaceFactor*rules[rank[lo]].Packets {
			break
		}
		in[rank[hi]], in[rank[lo]] = true, false
	}
	clear(t.shown)
	var out []int
	for i, ok := range in {
		if ok {
			t.shown[ids[i]] = true
			out = append(out, i)
		}
	}
	return out
}
