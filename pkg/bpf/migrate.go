package bpf

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
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
	if err := putArray(d.objs.RuleSlots, gone, make([]masqRuleSlot, len(gone))); err != nil {
		return 0, err
	}
	if err := putArray(d.objs.RuleSlots, keys, values); err != nil {
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

// natEmpty tells whether every flow table is empty.
func (d *Datapath) natEmpty() (bool, error) {
	for _, m := range []*ebpf.Map{d.objs.NatV4, d.objs.NatV6, d.objs.NatNewV4, d.objs.NatNewV6} {
		var k []byte
		err := m.NextKey(nil, &k)
		if err == nil {
			return false, nil
		}
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return false, err
		}
	}
	return true, nil
}

// natTableByName is the family's flow tables of a carried map: its own table (confirmed or
// unreplied) is where an entry of the same layout goes; entries of the layouts before the two
// tables (before firstTwoTableLayout) go where their state says.
func (d *Datapath) natTableByName(name string) natMigrator {
	if name == masqMapNatV6 || name == masqMapNatNewV6 {
		return d.natTable(policy.IPv6)
	}
	return d.natTable(policy.IPv4)
}

// natMigrator is what a migration does with one family's flow tables.
type natMigrator interface {
	// carry merges the entries of src (map name, of layout from) whose last_seen is at least
	// since; fast writes them in batches without merging (the tables are empty and no program
	// writes them). It returns how many it carried, and how many of them went to the unreplied
	// table for want of room in the confirmed one.
	carry(src *ebpf.Map, name string, from int, fast bool, since time.Duration) (n, noRoom int, err error)
	renameSlots(rename map[uint32]uint32) error
}

// firstTwoTableLayout is the first layout with a table of confirmed flows and one of unreplied
// flows, and the state flags of bpf/nat.h (ORIG, REPLIED on both halves).
const firstTwoTableLayout = 5

func (t natTableOf[K]) carry(src *ebpf.Map, name string, from int, fast bool, since time.Duration) (int, int, error) {
	var batch [2]struct {
		keys []K
		vals []masqNatEntry
	}
	n, noRoom := 0, 0
	flush := func(tbl Table) error {
		b := &batch[tbl]
		m := t.tables()[tbl]
		var err error
		if fast {
			err = putBatch(m, b.keys, b.vals)
			if errors.Is(err, unix.E2BIG) {
				// A confirmed table smaller than its flows: the rest one by one, those without
				// room to the unreplied table (what the batch put is found there, the same).
				fast = false
			}
		}
		if !fast {
			var full int
			full, err = t.merge(m, b.keys, b.vals)
			noRoom += full
		}
		n += len(b.keys)
		b.keys, b.vals = b.keys[:0], b.vals[:0]
		return err
	}
	own := TableConfirmed
	if name == masqMapNatNewV4 || name == masqMapNatNewV6 {
		own = TableUnreplied
	}
	keySize, valSize := int(unsafe.Sizeof(*new(K))), int(unsafe.Sizeof(masqNatEntry{}))
	err := walkRaw(src, func(k, v []byte) error {
		k, v = upgrade(name, from, k, v)
		if len(k) != keySize || len(v) != valSize {
			return fmt.Errorf("an entry of layout %d became %d+%d bytes, want %d+%d", from, len(k), len(v), keySize, valSize)
		}
		key, val := fromBytes[K](k), fromBytes[masqNatEntry](v)
		if time.Duration(val.LastSeen) < since {
			return nil
		}
		tbl := own
		if from < firstTwoTableLayout {
			partner, ok, err := rawPartner(src, name, from, key, &val)
			if err != nil {
				return err
			}
			val.Flags = masqNatFlags(flowFlags(key.tuple(), Kind(val.Kind), Flags(val.Flags), partner, ok))
			if Flags(val.Flags)&FlagReplied == 0 {
				tbl = TableUnreplied
			} else {
				tbl = TableConfirmed
			}
		}
		b := &batch[tbl]
		b.keys, b.vals = append(b.keys, key), append(b.vals, val)
		if len(b.keys) == natBatch {
			return flush(tbl)
		}
		return nil
	})
	for tbl := range batch {
		if err == nil && len(batch[tbl].keys) > 0 {
			err = flush(Table(tbl))
		}
	}
	return n, noRoom, err
}

// rawPartner reads, from a source table of an older layout, the flags of the other half of the
// flow whose entry (upgraded) is v at k; ok is false when it has none that points back.
func rawPartner[K rawNATKey[K]](src *ebpf.Map, name string, from int, k K, v *masqNatEntry) (Flags, bool, error) {
	kt := k.tuple()
	pk := k.withTuple(kt.partner(v))
	raw, pv := make([]byte, src.KeySize()), make([]byte, src.ValueSize())
	copy(raw, unsafe.Slice((*byte)(unsafe.Pointer(&pk)), len(raw)))
	if err := src.Lookup(raw, &pv); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("lookup nat entry: %w", err)
	}
	_, pv = upgrade(name, from, raw, pv)
	p := fromBytes[masqNatEntry](pv)
	if !kt.pointedBy(&p) {
		return 0, false, nil
	}
	return Flags(p.Flags), true, nil
}

// flowFlags are the flags of layout 5 for a half of an older layout's flow, from its flags and
// its partner's (layouts 1 to 3 set SEEN, bit 1, on the halves that carried a packet, and FIN or
// RST on the half whose direction carried one): the opener's half (egress for flows from pods
// and the host, ingress for inbound ones) is ORIG; a flow both of whose halves carried a packet
// is REPLIED, on both; FIN and RST go on both halves. The TCP fields start over (no ACK known,
// window scale unknown): the flow is judged liberally until its next packet each way.
func flowFlags(kt natTuple, kind Kind, own, partner Flags, paired bool) Flags {
	const seen = Flags(1)
	f := (own | partner) & (FlagFIN | FlagRST)
	if (kind == KindInbound) == (kt.dir == Ingress) {
		f |= FlagOrig
	}
	if paired && own&partner&seen != 0 {
		f |= FlagReplied
	}
	return f
}

// putBatch writes the entries keys[i], vals[i] into m: in one batch where the kernel can.
func putBatch[K, V any](m *ebpf.Map, keys []K, vals []V) error {
	_, err := m.BatchUpdate(keys, vals, nil)
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	for i := range keys {
		if err := m.Put(&keys[i], &vals[i]); err != nil {
			return err
		}
	}
	return nil
}

// merge writes entries into table m, which may hold them already, and which the programs may be
// changing meanwhile (see the comment at the top). A flow's entry found in the other table
// (the programs confirmed it meanwhile, or it is still unconfirmed) stays where the programs put
// it. An entry that finds the confirmed table full goes to the unreplied one, marked as the
// datapath marks a flow that finds no room (FlagNoRoom); noRoom counts them.
func (t natTableOf[K]) merge(m *ebpf.Map, keys []K, vals []masqNatEntry) (noRoom int, err error) {
	other := t.unreplied
	if m == t.unreplied {
		other = t.confirmed
	}
	for i := range keys {
		k, v := &keys[i], vals[i]
		var cur masqNatEntry
		if err := other.Lookup(k, &cur); err == nil {
			continue
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return noRoom, fmt.Errorf("merge nat entry: %w", err)
		}
		err := m.Lookup(k, &cur)
		held := err == nil
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return noRoom, fmt.Errorf("merge nat entry: %w", err)
		}
		if newer, err := t.newerFlowHolds(*k, &v, held, &cur); err != nil {
			return noRoom, err
		} else if newer {
			continue
		}
		switch {
		case !held:
			var full bool
			full, err = t.insert(m, k, &v)
			if full {
				noRoom++
			}
		case cur.Addr == v.Addr && cur.Port == v.Port:
			if merged := mergeEntry(cur, v); merged != cur {
				err = m.Put(k, &merged)
			}
		default:
			// An older flow's entry under this key: it gives way, with its other half.
			err = t.giveWay(*k, &cur)
			if err == nil {
				err = m.Put(k, &v)
			}
		}
		if err != nil {
			return noRoom, fmt.Errorf("merge nat entry: %w", err)
		}
	}
	return noRoom, nil
}

// newerFlowHolds tells whether the tables hold, under k (cur, when held) or under the key of v's
// other half, an entry of another flow seen later than v: that flow keeps its keys (it is the
// live one, as after the swap when v is an old program's frozen entry), and v is left out.
func (t natTableOf[K]) newerFlowHolds(k K, v *masqNatEntry, held bool, cur *masqNatEntry) (bool, error) {
	if held && (cur.Addr != v.Addr || cur.Port != v.Port) && cur.LastSeen > v.LastSeen {
		return true, nil
	}
	kt := k.tuple()
	pk := k.withTuple(kt.partner(v))
	var pv masqNatEntry
	found, _, err := t.lookup(&pk, &pv)
	if err != nil || !found {
		return false, err
	}
	return !kt.pointedBy(&pv) && pv.LastSeen > v.LastSeen, nil
}

// insert adds v at k in m, where a packet may have made an entry meanwhile (the new programs'
// entry then stands); full tells that the confirmed table had no room, so that v went to the
// unreplied one, marked as the datapath marks such a flow.
func (t natTableOf[K]) insert(m *ebpf.Map, k *K, v *masqNatEntry) (full bool, err error) {
	err = m.Update(k, v, ebpf.UpdateNoExist)
	if errors.Is(err, ebpf.ErrKeyExist) {
		return false, nil
	}
	if !errors.Is(err, unix.E2BIG) || m != t.confirmed {
		return false, err
	}
	v.Flags |= masqNatFlagsNAT_F_NOROOM
	err = t.unreplied.Update(k, v, ebpf.UpdateNoExist)
	if errors.Is(err, ebpf.ErrKeyExist) {
		return false, nil
	}
	return err == nil, err
}

// giveWay removes the other half of the flow whose entry cur sits at k, from either table.
func (t natTableOf[K]) giveWay(k K, cur *masqNatEntry) error {
	pk, _, paired, err := t.lookupPartner(k, cur)
	if err != nil || !paired {
		return err
	}
	for _, tm := range t.tables() {
		if err := tm.Delete(&pk); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// mergeEntry is the entry a table keeps of two of one flow: the one seen last, with both
// entries' flags when they were seen within the same refresh interval (either may have seen a
// FIN the other has not).
func mergeEntry(a, b masqNatEntry) masqNatEntry {
	if a.LastSeen > b.LastSeen {
		a, b = b, a
	}
	if time.Duration(b.LastSeen-a.LastSeen) < refreshInterval {
		b.Flags |= a.Flags
	}
	return b
}

// renameSlots renames the counter slots entries name, by rename (old slot -> new one).
func (t natTableOf[K]) renameSlots(rename map[uint32]uint32) error {
	var inner error
	err := t.each(func(k K, v *masqNatEntry, tbl Table) bool {
		to, ok := rename[v.Slot]
		if !ok || v.Slot == noSlot {
			return true
		}
		e := *v
		e.Slot = to
		if err := t.tables()[tbl].Update(&k, &e, ebpf.UpdateExist); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			inner = err
			return false
		}
		return true
	})
	return cmp.Or(inner, err)
}

func nonZero(b []byte) bool { return slices.ContainsFunc(b, func(c byte) bool { return c != 0 }) }

// fromBytes is the value of type T whose bytes are b (the generated types have the C layout).
func fromBytes[T any](b []byte) T {
	var t T
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&t)), unsafe.Sizeof(t)), b)
	return t
}

// rawBatch is a buffer of n entries of size bytes each, as the slice of arrays the library's
// batch operations take, and its bytes.
func rawBatch(n, size int) (any, []byte) {
	v := reflect.MakeSlice(reflect.SliceOf(reflect.ArrayOf(size, reflect.TypeFor[byte]())), n, n)
	return v.Interface(), unsafe.Slice((*byte)(v.UnsafePointer()), n*size)
}

// walkRaw calls fn with every entry of a map without per-CPU values, its key and value as bytes
// valid during the call: a batch lookup at a time where the kernel can (a map of an older
// layout has no Go types in this build), else key by key.
func walkRaw(m *ebpf.Map, fn func(key, value []byte) error) error {
	ks, vs := int(m.KeySize()), int(m.ValueSize())
	keys, kb := rawBatch(natBatch, ks)
	vals, vb := rawBatch(natBatch, vs)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			return walkRawByKey(m, fn)
		}
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return err
		}
		for i := range n {
			if err := fn(kb[i*ks:(i+1)*ks], vb[i*vs:(i+1)*vs]); err != nil {
				return err
			}
		}
		if done {
			return nil
		}
	}
}

func walkRawByKey(m *ebpf.Map, fn func(key, value []byte) error) error {
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		if err := fn(k, v); err != nil {
			return err
		}
	}
	return it.Err()
}
