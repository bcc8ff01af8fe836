package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"unsafe"

	"github.com/cilium/ebpf"
)

// replaceResized makes Load make anew the maps of opened.Resized: the flow state's are set
// aside (SetAside) for a migration to carry, which it tells, the others' pins removed.
func replaceResized(dir string, opened *Opened) (aside bool, err error) {
	var dropped []string
	for _, m := range opened.Resized {
		if carriedOnResize(m.Map) {
			opened.Carried = append(opened.Carried, m.Map)
		} else {
			dropped = append(dropped, m.Map)
		}
		if slices.Contains(ruleTrieMaps, m.Map) && !slices.Contains(dropped, sourceMaps[0]) {
			dropped = append(dropped, sourceMaps...)
		}
	}
	if len(opened.Carried) > 0 {
		if _, err := SetAside(dir, opened.Carried...); err != nil {
			return false, err
		}
	}
	return len(opened.Carried) > 0, RemovePins(dir, dropped...)
}

// pinnedRuleCapacity returns the MaxRules of the maps pinned in dir, or 0 when none are pinned.
func pinnedRuleCapacity(dir string) (uint32, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, masqMapRuleSlots), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("open pinned %s: %w", masqMapRuleSlots, err)
	}
	defer m.Close()
	return m.MaxEntries(), nil
}

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

// Grow returns a datapath whose rule maps hold need slots (a policy's SlotsNeeded): d itself
// where they do, else one loaded over the same pins with larger rule maps (CapacityFor), every
// other map kept (the NAT tables with their flows), that continues d's slot assignment and
// counters (AdoptRuleSlots). The programs still attached keep using d's rule maps until the
// caller replaces them with the new ones, so traffic always meets a complete rule set; then the
// caller closes d.
func (d *Datapath) Grow(need int) (*Datapath, error) {
	if need <= d.RuleCapacity() {
		return d, nil
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
	// The rule tries are made anew (they are sized by MaxRules), and so are the maps that name
	// their ids: AdoptRuleSlots carries the ids.
	if err := RemovePins(lopts.PinPath, sourceMaps...); err != nil {
		return nil, err
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

// AdoptRuleSlots copies from's counter slot assignment and counters into d, slot for slot, and
// its source rules' ids and settings, so that d continues where from left off: rules that stay
// keep their counters, and established flows, whose NAT entries name a slot, keep counting into
// their rule. d must have at least from's capacity and hold no rules yet (its rule maps were
// just created).
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
		if err := d.objs.SlotSource.Put(s, uint32(k.set)); err != nil {
			return fmt.Errorf("adopt rule slots: write the source rule of slot %d: %w", s, err)
		}
	}
	for id := range from.srcNames {
		var rule masqSrcRule
		if err := from.objs.SrcCfg.Lookup(id, &rule); err != nil {
			return fmt.Errorf("adopt rule slots: read source rule %d: %w", id, err)
		}
		if err := d.objs.SrcCfg.Put(id, &rule); err != nil {
			return fmt.Errorf("adopt rule slots: write source rule %d: %w", id, err)
		}
	}
	// Read the assignment back as a restarted agent would; the tries are still empty, so the
	// next SyncPolicy writes them whole.
	return d.recover()
}

// carriedOnResize tells whether the entries of a map whose size changed are carried into the
// new one (SetAside): the flow state's (NAT tables, kept verdicts, fragments, inbound openers).
// The other maps whose size can change are the policy's, which a sync writes again, and the rule
// counters, which a policy that outgrows them carries itself (Grow).
func carriedOnResize(name string) bool {
	return carried[name] == carryFlows || carried[name] == carryEntries
}
