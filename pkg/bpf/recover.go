package bpf

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Refresh re-reads what decides verdicts (the tries and the port table) instead of trusting
// what this process last wrote, so that the next SyncPolicy also repairs entries changed or
// removed behind its back (drift). The counter slots stay as this process assigned them: their
// order of reuse (see slotTable) lives only here.
func (d *Datapath) Refresh() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.recoverTries()
}

// recover reads back the slot assignment and the tries, so that a datapath loaded over pinned
// maps continues where the previous agent left off.
func (d *Datapath) recover() error {
	d.slots = newSlotTable(d.opts.MaxRules)
	d.syncedPlan, d.syncedSlots = nil, nil // of another table
	// Which source rule's list each slot's rule is in (0, the global lists, where the maps
	// predate source rules).
	sets := map[uint32]uint16{}
	if err := eachEntry(d.objs.SlotSource, func(slot uint32, set *uint32) {
		if *set != 0 {
			sets[slot] = uint16(*set)
		}
	}); err != nil {
		return fmt.Errorf("read %s: %w", masqMapSlotSource, err)
	}
	last := -1
	inUse := map[uint32]bool{}
	if err := eachEntry(d.objs.RuleSlots, func(slot uint32, value *masqRuleSlot) {
		if k, ok := slotKeyOf(*value); ok {
			k.set = sets[slot]
			d.slots.bySlt[slot], d.slots.byKey[k] = k, slot
			inUse[slot] = true
			last = max(last, int(slot))
		}
	}); err != nil {
		return fmt.Errorf("read rule_slots: %w", err)
	}
	d.slots.next = uint32(last + 1)
	for s := uint32(0); s < d.slots.next; s++ {
		if !inUse[s] {
			d.slots.free = append(d.slots.free, s)
		}
	}
	return d.recoverTries()
}

// recoverTries reads back the tries, the port ranges and the held ports.
func (d *Datapath) recoverTries() error {
	// The port table matches the ranges of nat_config when a sync wrote both.
	var cfg masqNatConfig
	if err := d.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("read nat_config: %w", err)
	}
	if d.portSeed = cfg.PortSeed; d.portSeed == 0 {
		d.portSeed = newPortSeed()
	}
	d.ports = nil
	for _, r := range cfg.Ranges[:min(int(cfg.Nranges), len(cfg.Ranges))] {
		d.ports = append(d.ports, policy.PortRange{First: r.First, Last: r.Last})
	}
	d.held = portBits{}
	if err := eachEntry(d.objs.HeldPorts, func(i uint32, w *uint64) { d.held[i] = *w }); err != nil {
		return fmt.Errorf("read held_ports: %w", err)
	}

	d.tries = d.newTries()
	for _, t := range d.tries {
		if err := t.read(); err != nil {
			return err
		}
	}
	// The source rules' ids may differ from those the cached plan was made with.
	d.planned, d.plan = nil, nil
	return d.recoverSources()
}

// newPortSeed is a secret for nat_config's port_seed: nonzero, so that a zero read back means
// "never written".
func newPortSeed() uint32 {
	var b [4]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			panic(fmt.Sprintf("crypto/rand: %v", err)) // cannot fail on Linux
		}
		if s := binary.NativeEndian.Uint32(b[:]); s != 0 {
			return s
		}
	}
}
