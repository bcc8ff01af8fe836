package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
)

// A migration carries what the maps of older layouts hold into this build's (layout.go says
// which maps and how), in passes around the moment the caller swaps the programs:
//
//  1. Migrate, before the swap, while the old programs still run: every carried entry, so that
//     the new programs find every flow, slot, counter and uplink from their first packet.
//  2. CatchUp, right before the swap: the flows and fragments the old programs made or touched
//     during the first pass (which reads a large table for a fraction of a second), so that
//     what the new programs miss at the swap is only what the old ones did during this pass.
//  3. Finish, once the new programs run on every device: what the old programs did since
//     (flows, fragments, counts), then the old pins go.
//
// A flow merged into a table that holds it already keeps the entry seen last (its flags
// combined when both were seen within the same second). Where the table holds another flow
// under the key of a half merged, or under the key of its other half, the flow seen last keeps
// the keys: an older one gives way with its other half; a newer one stays, and the half merged
// is left out. Merging again is harmless, so a migration interrupted anywhere (the agent
// killed) is simply done again by the next agent.
//
// Killed after the swap, an agent leaves this build's maps in use by its programs and the old
// ones frozen: the next agent finds the migration swapped, by the mark the first one made right
// before it swapped (swappedMark). Its passes then
// carry only what the new programs may lack: the flows and fragments the old programs made
// before the swap that no newer entry displaced. The rule slots, uplinks, totals and counters
// are the new maps' already (they were carried before the swap, and the new programs count
// into them); only the growth of the old counters after its first pass is added by Finish,
// should an old program still run somewhere.

// refreshInterval is how much older than the time a packet touched it a NAT entry's last_seen
// can be (C: REFRESH_NS): an entry touched since a moment has a last_seen no older than that
// moment minus this.
const refreshInterval = time.Second

// Migration is a migration whose first pass is done (Datapath.Migrate).
type Migration struct {
	sources []*source
	// mark is the mark of a swapped migration (swappedMark); swapped tells that it was there
	// when the migration began (an earlier agent swapped the programs and was stopped before it
	// finished), or that the caller made it (Swapping).
	mark    string
	swapped bool
	// since: the entries the old programs touched from then on are carried again by the next
	// pass.
	since time.Duration
	// Entries counts, by map, the entries carried into this build's maps (of arrays, those that
	// are not all zero).
	Entries map[string]int
	// NoRoom counts the halves of confirmed flows that found no room in this build's confirmed
	// table (smaller than the flows it had, --nat-max-entries lowered): they went to the
	// unreplied table, where they work and can be evicted, as when the datapath finds the
	// confirmed table full (FlagNoRoom).
	NoRoom int
}

// source is a Source with its carried maps open.
type source struct {
	Source
	open map[string]*ebpf.Map
	// counters holds what the counters of each carryCounters map were at the first pass (by
	// key, per CPU, in this build's layout): Finish adds what they grew by since.
	counters map[string]map[uint32][][]byte
	// slots is the source's slot table, for rule counters.
	slots map[uint32]slotKey
}

// Sources returns the sources the migration reads.
func (m *Migration) Sources() []Source {
	out := make([]Source, len(m.sources))
	for i, s := range m.sources {
		out[i] = s.Source
	}
	return out
}

// Migrate carries the entries of srcs (Inspect's Pins.Sources, in that order) into d's maps:
// the first pass of a migration. Call it before d's programs replace the old ones, and Finish
// once they have. Nothing is written to the sources.
func (d *Datapath) Migrate(srcs []Source) (*Migration, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := &Migration{since: MonotonicNow() - refreshInterval, Entries: map[string]int{}, mark: swappedMark(d.opts.PinPath)}
	fresh, err := d.natEmpty()
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(m.mark); err == nil {
		m.swapped = true
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	for _, s := range srcs {
		src, err := openSource(s)
		if err != nil {
			m.close()
			return nil, err
		}
		m.sources = append(m.sources, src)
		if err := m.carry(d, src, passFirst, fresh); err != nil {
			m.close()
			return nil, fmt.Errorf("migrate from %s: %w", s, err)
		}
		fresh = false
	}
	// The slot assignment is the one the sources left; the tries start empty.
	if err := d.recover(); err != nil {
		m.close()
		return nil, err
	}
	return m, nil
}

// CatchUp carries the flows and fragments the old programs made or touched since the last pass:
// call it right before the swap. d is the datapath in use (see Finish). Once swapped, it does
// nothing: the old programs no longer run.
func (m *Migration) CatchUp(d *Datapath) error {
	if m.swapped {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return m.pass(d, passCatchUp)
}

// Swapping, called right before this build's programs replace the old ones, marks the
// migration swapped (swappedMark): an agent stopped from then on before Finish leaves the mark
// to the next one, whose passes then take the old maps for frozen. An apply that fails after
// the swap finishes the migration at the next one, as swapped.
func (m *Migration) Swapping() error {
	if m.swapped {
		return nil
	}
	if err := os.Mkdir(m.mark, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("mark the migration swapped: %w", err)
	}
	m.swapped = true
	return nil
}

// swappedMark is the mark of a migration into the maps of dir (LayoutDir) whose programs may
// have replaced the old ones: a directory beside dir, which Inspect and the agents of every
// layout pass over, made right before the swap and removed once the migration is finished.
func swappedMark(dir string) string { return dir + "-swapped" }

// Resumed tells that the migration was found swapped: an earlier agent replaced the old
// programs and was stopped before it finished.
func (m *Migration) Resumed() bool { return m.swapped }

// Finish, once d's programs run wherever the old ones did, carries what the old programs did
// since the last pass, and removes the sources' pins. d is the datapath now in use (it may be
// another than Migrate's, over the same pins, after the rule maps grew). On error Finish may be
// called again (no pin is removed before every entry is carried).
func (m *Migration) Finish(d *Datapath) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := m.pass(d, passFinal); err != nil {
		return err
	}
	for _, src := range m.sources {
		if err := src.remove(); err != nil {
			return err
		}
	}
	if err := os.Remove(m.mark); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the mark of the swap: %w", err)
	}
	m.close()
	return nil
}

// pass runs a pass after the first over every source; the next pass starts where it did.
func (m *Migration) pass(d *Datapath, p pass) error {
	next := MonotonicNow() - refreshInterval
	for _, src := range m.sources {
		if err := m.carry(d, src, p, false); err != nil {
			return fmt.Errorf("migrate from %s: %w", src.Source, err)
		}
	}
	m.since = next
	return nil
}

func (m *Migration) close() {
	for _, src := range m.sources {
		for _, mp := range src.open {
			mp.Close()
		}
	}
}

func openSource(s Source) (*source, error) {
	src := &source{Source: s, open: map[string]*ebpf.Map{}, counters: map[string]map[uint32][][]byte{}}
	for name := range s.layouts {
		if carried[name] == 0 {
			continue
		}
		mp, err := ebpf.LoadPinnedMap(filepath.Join(s.Dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			for _, o := range src.open {
				o.Close()
			}
			return nil, fmt.Errorf("open %s of %s: %w", name, s, err)
		}
		src.open[name] = mp
	}
	return src, nil
}

// pass is one of a migration's passes.
type pass int

const (
	passFirst   pass = iota // Migrate: everything carried
	passCatchUp             // CatchUp: flows and fragments since the last pass
	passFinal               // Finish: and the counters' growth since the first pass
)

// carryOrder is the order maps are carried in: the slot assignment before the flows that name
// slots.
var carryOrder = []carry{carryOnce, carryCounters, carryEntries, carryFlows}

// carry carries one source into d in pass p. fresh tells that d's NAT tables were empty before
// the first pass (a layout directory just made).
func (m *Migration) carry(d *Datapath, src *source, p pass, fresh bool) error {
	targets := d.Maps()
	for _, kind := range carryOrder {
		for _, name := range slices.Sorted(maps.Keys(src.open)) {
			if carried[name] != kind {
				continue
			}
			mp, dst, from := src.open[name], targets[name], src.layouts[name]
			n, err := 0, error(nil)
			switch {
			case kind == carryOnce && p != passFirst, kind == carryCounters && p == passCatchUp:
			case kind == carryOnce && name == masqMapRuleSlots:
				n, err = d.carrySlots(src, mp, from, fresh, m.swapped)
			case kind == carryOnce && m.swapped:
			case kind == carryOnce, kind == carryEntries:
				n, err = copyEntries(mp, dst, name, from, m.swapped)
			case kind == carryCounters:
				n, err = d.carryCounters(src, mp, dst, name, from, p == passFinal, m.swapped)
			case kind == carryFlows:
				since := time.Duration(0)
				if p != passFirst {
					since = m.since
				}
				var noRoom int
				n, noRoom, err = d.natTableByName(name).carry(mp, name, from, fresh && p == passFirst, since)
				m.NoRoom += noRoom
			}
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			m.Entries[name] += n
		}
	}
	return nil
}

// copyEntries writes every entry of src (of layout from) into dst, converted: what dst held
// under the same keys is replaced, the rest kept; with keep (the migration is swapped, dst in
// use), what dst holds is kept.
func copyEntries(src, dst *ebpf.Map, name string, from int, keep bool) (int, error) {
	flags := ebpf.UpdateAny
	if keep {
		flags = ebpf.UpdateNoExist
	}
	n := 0
	err := walkRaw(src, func(k, v []byte) error {
		k, v = upgrade(name, from, k, v)
		if err := dst.Update(k, v, flags); errors.Is(err, ebpf.ErrKeyExist) {
			return nil
		} else if err != nil {
			return err
		}
		if nonZero(v) {
			n++
		}
		return nil
	})
	return n, err
}

// carrySlots makes d's slot assignment the source's: slots d assigned that the source does not
// are freed. When d's maps held flows already (a migration done before, or the maps of an agent
// of this layout before a rollback), the flows that name a slot are renamed to the slot their
// rule has in the source's assignment, or to none where the source has no such rule, so that
// they keep counting into their rule. Swapped, d's assignment stands (its programs count by
// it), and the source's is only read, for its counters (carryCounters).
func (d *Datapath) carrySlots(src *source, mp *ebpf.Map, from int, fresh, swapped bool) (int, error) {
	src.slots = map[uint32]slotKey{}
	var values []masqRuleSlot
	var keys []uint32
	err := walkRaw(mp, func(k, v []byte) error {
		k, v = upgrade(masqMapRuleSlots, from, k, v)
		slot, val := binary.NativeEndian.Uint32(k), fromBytes[masqRuleSlot](v)
		if sk, ok := slotKeyOf(val); ok {
			src.slots[slot] = sk
			keys, values = append(keys, slot), append(values, val)
		}
		return nil
	})
	if err != nil || swapped {
		return 0, err
	}
	if max := d.objs.RuleSlots.MaxEntries(); len(keys) > 0 && slices.Max(keys) >= max {
		return 0, fmt.Errorf("slot %d does not fit in %d rule slots", slices.Max(keys), max)
	}
	old, err := d.readSlots()
	if err != nil {
		return 0, err
	}
	bySlotKey := map[slotKey]uint32{}
	for s, k := range src.slots {
		bySlotKey[k] = s
	}
	rename := map[uint32]uint32{}
	var gone []uint32
	for s, k := range old {
		to, ok := bySlotKey[k]
		if !ok {
			to = noSlot
		}
		if to != s {
			rename[s] = to
		}
		if _, kept := src.slots[s]; !kept {
			gone = append(gone, s)
		}
	}
	if err := putAll(d.objs.RuleSlots, gone, make([]masqRuleSlot, len(gone))); err != nil {
		return 0, err
	}
	if err := putAll(d.objs.RuleSlots, keys, values); err != nil {
		return 0, err
	}
	if !fresh && len(rename) > 0 {
		for _, name := range []string{masqMapNatV4, masqMapNatV6} { // each: both of its family's tables
			if err := d.natTableByName(name).renameSlots(rename); err != nil {
				return 0, err
			}
		}
	}
	return len(keys), nil
}

// readSlots reads d's slot assignment from rule_slots.
func (d *Datapath) readSlots() (map[uint32]slotKey, error) {
	out := map[uint32]slotKey{}
	err := eachEntry(d.objs.RuleSlots, func(s uint32, v *masqRuleSlot) {
		if k, ok := slotKeyOf(*v); ok {
			out[s] = k
		}
	})
	return out, err
}

// carryCounters, in the first pass, sets d's counters to the source's and remembers them (only
// remembers them when swapped: d's hold the source's and what the new programs counted since);
// after the swap, it adds what the source's counters grew by since the last time: for rule
// counters, to the slots whose rule is the one the source's slot counted. Rule counters are read
// for the slots the source assigned only (a free slot's are zeroed when it is assigned), a
// lookup each.
func (d *Datapath) carryCounters(src *source, mp, dst *ebpf.Map, name string, from int, after, swapped bool) (int, error) {
	var keys []uint32
	if name == masqMapRuleStats {
		keys = slices.Sorted(maps.Keys(src.slots))
	} else {
		for k := range min(mp.MaxEntries(), dst.MaxEntries()) {
			keys = append(keys, k)
		}
	}
	var dstSlots map[uint32]slotKey
	if after && name == masqMapRuleStats {
		var err error
		if dstSlots, err = d.readSlots(); err != nil {
			return 0, err
		}
	}
	if !after {
		src.counters[name] = map[uint32][][]byte{}
	}
	seen := src.counters[name]
	n := 0
	for _, key := range keys {
		if key >= dst.MaxEntries() {
			continue
		}
		var vs [][]byte
		if err := mp.Lookup(key, &vs); err != nil {
			return n, err
		}
		k := binary.NativeEndian.AppendUint32(nil, key)
		for i := range vs {
			_, vs[i] = upgrade(name, from, k, vs[i])
		}
		if !after {
			seen[key] = vs
			if swapped {
				continue
			}
			if slices.ContainsFunc(vs, nonZero) {
				n++
			}
			if err := dst.Put(key, vs); err != nil {
				return n, err
			}
			continue
		}
		if name == masqMapRuleStats && src.slots[key] != dstSlots[key] {
			continue // the slot holds another rule now, or none
		}
		grown, err := addCounters(dst, key, vs, seen[key])
		if err != nil {
			return n, err
		}
		seen[key] = vs // a Finish done again adds only what grew since
		if grown {
			n++
		}
	}
	return n, nil
}

// addCounters adds to dst's per-CPU 64-bit counters at key what now holds beyond before.
func addCounters(dst *ebpf.Map, key uint32, now, before [][]byte) (bool, error) {
	var cur [][]byte
	if err := dst.Lookup(key, &cur); err != nil {
		return false, err
	}
	grown := false
	for cpu := range min(len(now), len(cur)) {
		for off := 0; off+8 <= len(now[cpu]); off += 8 {
			delta := binary.NativeEndian.Uint64(now[cpu][off:])
			if before != nil {
				delta -= binary.NativeEndian.Uint64(before[cpu][off:])
			}
			if delta != 0 {
				grown = true
				binary.NativeEndian.PutUint64(cur[cpu][off:], binary.NativeEndian.Uint64(cur[cpu][off:])+delta)
			}
		}
	}
	if !grown {
		return false, nil
	}
	return true, dst.Put(key, cur)
}

func nonZero(b []byte) bool { return slices.ContainsFunc(b, func(c byte) bool { return c != 0 }) }

// fromBytes is the value of type T whose bytes are b (the generated types have the C layout).
func fromBytes[T any](b []byte) T {
	var t T
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&t)), unsafe.Sizeof(t)), b)
	return t
}
