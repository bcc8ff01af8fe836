package bpf

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The rule maps (the four tries, rule_stats and rule_slots) are sized by LoadOptions.MaxRules.
// A policy larger than they allow is served by loading maps with more room and adopting the old
// ones' slots and counters (AdoptRuleSlots); these helpers tell when and how large.

// The rule maps start with as many slots as ruleMapBudget of kernel memory holds on this
// machine (rule_stats has a copy per CPU), a power of two between minRules and maxStartRules:
// 32768 on 2 CPUs, 4096 from 16 CPUs on. A larger policy grows them, once, which costs a
// program reload (a few hundred milliseconds); a start size that holds the common configs
// avoids it. The tries allocate per entry and cost nothing until used.
const (
	ruleMapBudget = 2 << 20
	minRules      = 4096
	maxStartRules = 32768
)

// DefaultMaxRules is the MaxRules the rule maps are loaded with when nothing asks for more.
func DefaultMaxRules() uint32 {
	perSlot := uint32(unsafe.Sizeof(masqRuleStats{}))*uint32(ebpf.MustPossibleCPU()) + uint32(unsafe.Sizeof(masqRuleSlot{}))
	n := uint32(maxStartRules)
	for n > minRules && n*perSlot > ruleMapBudget {
		n /= 2
	}
	return n
}

// RuleCapacity is the number of rule counter slots of the loaded maps.
func (d *Datapath) RuleCapacity() int { return int(d.opts.MaxRules) }

// SlotsNeeded returns how many counter slots a SyncPolicy of p holds at its peak: the rules that
// stay and the rules it adds, while the rules it removes still hold theirs.
func (d *Datapath) SlotsNeeded(p *policy.Policy) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	pl, err := d.planFor(p)
	if err != nil {
		return 0, err
	}
	n := len(d.slots.byKey)
	for _, k := range pl.keys {
		if _, ok := d.slots.byKey[k]; !ok {
			n++
		}
	}
	return n, nil
}

// CapacityFor is the MaxRules to load for n rules: the default, or twice n rounded up to a power
// of two, so that a policy can be replaced by one of the same size (both hold slots during the
// sync) and growth is rare.
func CapacityFor(n int) uint32 {
	c := DefaultMaxRules()
	for int(c) < 2*n {
		c *= 2
	}
	return c
}

// Grow returns a datapath whose rule maps can hold a sync of p: d itself where they can, else one
// loaded over the same pins with larger rule maps (CapacityFor), every other map kept (the NAT
// tables with their flows), that continues d's slot assignment and counters (AdoptRuleSlots).
// The programs still attached keep using d's rule maps until the caller replaces them with the
// new ones, so traffic always meets a complete rule set; then the caller closes d.
func (d *Datapath) Grow(p *policy.Policy) (*Datapath, error) {
	need, err := d.SlotsNeeded(p)
	if err != nil || need <= d.RuleCapacity() {
		return d, err
	}
	lopts := d.opts
	lopts.MaxRules = CapacityFor(need)
	resized, err := CheckPins(lopts)
	if err != nil {
		return nil, err
	}
	for _, m := range resized {
		if err := RemovePins(lopts.PinPath, m.Map); err != nil {
			return nil, err
		}
	}
	bigger, err := Load(lopts)
	if err != nil {
		return nil, err
	}
	if err := bigger.AdoptRuleSlots(d); err != nil {
		bigger.Close()
		return nil, err
	}
	return bigger, nil
}

// AdoptRuleSlots copies from's counter slot assignment and counters into d, slot for slot, so
// that d continues where from left off: rules that stay keep their counters, and established
// flows, whose NAT entries name a slot, keep counting into their rule. d must have at least
// from's capacity and hold no rules yet (its rule maps were just created).
func (d *Datapath) AdoptRuleSlots(from *Datapath) error {
	if d.RuleCapacity() < from.RuleCapacity() {
		return fmt.Errorf("adopt rule slots: %d slots cannot hold %d", d.RuleCapacity(), from.RuleCapacity())
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.slots.byKey) > 0 {
		return errors.New("adopt rule slots: the maps already hold rules")
	}
	from.mu.Lock()
	defer from.mu.Unlock()
	var stats []masqRuleStats
	for s, k := range from.slots.bySlt {
		v := k.value()
		if err := d.objs.RuleSlots.Put(s, &v); err != nil {
			return fmt.Errorf("adopt rule slots: write slot %d: %w", s, err)
		}
		if err := from.objs.RuleStats.Lookup(s, &stats); err != nil {
			return fmt.Errorf("adopt rule slots: read counters of slot %d: %w", s, err)
		}
		if err := d.objs.RuleStats.Put(s, stats); err != nil {
			return fmt.Errorf("adopt rule slots: write counters of slot %d: %w", s, err)
		}
	}
	// Read the assignment back as a restarted agent would; the tries are still empty, so the
	// next SyncPolicy writes them whole.
	return d.recover()
}

// Kernel memory of the NAT tables, as the kernel lays out a preallocated hash map: an element
// per entry (a header, then the key and the value, each rounded up to 8 bytes) and a bucket per
// entry rounded up to a power of two.
const (
	htabElemHeader = 48
	htabBucket     = 16
)

func htabBytes(entries uint32, key, value uintptr) uint64 {
	round := func(n uintptr) uint64 { return uint64(n+7) &^ 7 }
	buckets := uint64(1)
	for buckets < uint64(entries) {
		buckets <<= 1
	}
	return uint64(entries)*(htabElemHeader+round(key)+round(value)) + buckets*htabBucket
}

// NATMemory is the kernel memory, in bytes, of one family's NAT tables when LoadOptions sizes its
// confirmed table at n entries (the unreplied and keep tables follow from n).
func NATMemory(n uint32, v6 bool) uint64 {
	key := unsafe.Sizeof(masqNat4Key{})
	if v6 {
		key = unsafe.Sizeof(masqNat6Key{})
	}
	value, keep := unsafe.Sizeof(masqNatEntry{}), unsafe.Sizeof(masqKeepEntry{})
	return htabBytes(n, key, value) + htabBytes(unrepliedEntries(n), key, value) + htabBytes(keepEntries(n), key, keep)
}
