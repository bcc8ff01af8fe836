package bpfbackend

import (
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// ensureCapacity returns a datapath whose rule maps can hold a sync of p. When the loaded maps
// are too small (a config with more CIDRs than they were sized for), it loads larger rule maps
// over the same pins (the NAT table and every other map are kept), adopts the old slot
// assignment and counters slot for slot, and retires the old datapath. The programs still
// attached keep using the old rule maps until Apply replaces them with the new ones, so traffic
// always meets a complete rule set.
func (b *Backend) ensureCapacity(dp *bpf.Datapath, p *policy.Policy) (*bpf.Datapath, error) {
	need, err := dp.SlotsNeeded(p)
	if err != nil {
		return nil, err
	}
	if need <= dp.RuleCapacity() {
		return dp, nil
	}
	capacity := bpf.CapacityFor(need)
	b.log.Info("the policy needs more rule slots than the maps have; loading larger rule maps, keeping the counters",
		"slots", need, "from", dp.RuleCapacity(), "to", capacity)
	bigger, err := b.load(p, capacity)
	if err != nil {
		return nil, err
	}
	if err := bigger.AdoptRuleSlots(dp); err != nil {
		bigger.Close()
		return nil, err
	}
	b.dp.Store(bigger)
	if err := dp.Close(); err != nil {
		b.log.Warn("closing the smaller rule maps", "error", err)
	}
	return bigger, nil
}
