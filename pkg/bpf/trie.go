package bpf

import (
	"encoding/binary"
	"fmt"
	"iter"
	"math"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// trieKey is a prefix in one of the four tries.
type trieKey = netip.Prefix

// trieKind is what a trie holds: the rules of one family and action, of the global lists (set
// 0) or of the source rule whose id is set (its entries in the rule tries, under its id).
type trieKind struct {
	family policy.Family
	action policy.Action
	set    uint32
}

// trie is one of the four LPM tries, wrapped once: what it holds, its map with the operations of
// its family's key layout, and what this process last wrote into it.
type trie struct {
	trieKind
	name string
	m    *ebpf.Map
	ops  trieOps
	// held mirrors the map (prefix -> value of the entries that hold the trie's action), so
	// that a sync writes only the difference.
	held map[trieKey]trieValue
	// synced is what the last sync wrote, in prefixOrder, while held is exactly that (nil
	// otherwise: after a read, or a sync that failed midway), for the next sync's diffSorted.
	synced []trieEntry
}

// trieValue is what a trie entry holds: the verdict, the counter slot of the rule that decides
// it, and that rule's masquerade address where it is its own (policy.Rule.Address; invalid:
// none, the C value holds zero and the family's masqueradeAddress or else the uplink's address
// is used).
//
// In the source tries (src_v4, src_v6) an entry holds rule, the id of the source rule that
// decides its addresses, and nothing else.
type trieValue struct {
	action policy.Action
	slot   uint32
	snat   netip.Addr
	rule   uint32
}

// newTries lists the tries of the loaded maps, in the order CheckPolicy reports them, with
// empty mirrors.
func (d *Datapath) newTries() []*trie {
	o := &d.objs
	v4, v6 := lpmOps[masqLpm4Key, masqLpm4Val]{}, lpmOps[masqLpm6Key, masqLpm6Val]{}
	return []*trie{
		{trieKind{policy.IPv4, policy.Masquerade, 0}, masqMapMasqV4, o.MasqV4, v4, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv4, policy.Return, 0}, masqMapNomasqV4, o.NomasqV4, v4, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv6, policy.Masquerade, 0}, masqMapMasqV6, o.MasqV6, v6, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv6, policy.Return, 0}, masqMapNomasqV6, o.NomasqV6, v6, map[trieKey]trieValue{}, nil},
	}
}

// read replaces the mirror with what the map holds. An entry with another action than the
// trie's is left out of it, so that the next sync writes it again.
func (t *trie) read() error {
	t.held, t.synced = map[trieKey]trieValue{}, nil
	err := t.ops.read(t.m, func(p trieKey, v trieValue) {
		if v.action == t.action {
			t.held[p] = v
		}
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", t.name, err)
	}
	return nil
}

// put writes entries (which hold the trie's action), a batch at a time where the kernel can.
func (t *trie) put(entries []trieEntry) error {
	if len(entries) == 0 {
		return nil
	}
	if err := t.ops.put(t.m, entries); err != nil {
		return fmt.Errorf("write %s: %w", t.name, err)
	}
	for _, e := range entries {
		t.held[e.prefix] = e.trieValue
	}
	return nil
}

// delete deletes prefixes, a batch at a time where the kernel can; prefixes already gone are
// fine where it cannot.
func (t *trie) delete(prefixes []trieKey) error {
	if len(prefixes) == 0 {
		return nil
	}
	if err := t.ops.delete(t.m, prefixes); err != nil {
		return fmt.Errorf("delete from %s: %w", t.name, err)
	}
	for _, p := range prefixes {
		delete(t.held, p)
	}
	return nil
}

// trieOps are the map operations of one family's layout (masqLpm4Key and masqLpm4Val, or the
// IPv6 ones).
type trieOps interface {
	read(m *ebpf.Map, fn func(trieKey, trieValue)) error
	put(m *ebpf.Map, entries []trieEntry) error
	delete(m *ebpf.Map, prefixes []trieKey) error
	// walk starts a walk of the map's entries in key order (see trieWalk).
	walk(m *ebpf.Map) trieWalk
}

// trieEntry is an entry as a trie holds it.
type trieEntry struct {
	prefix trieKey
	trieValue
}

// trieWalk reads a trie's entries in key order, some at a time, across calls: next returns up
// to max entries and whether the walk is done. When the entry it stopped at is gone, the map
// starts it over from the first entry.
type trieWalk interface {
	next(max int) (entries []trieEntry, done bool, err error)
}

// rawLPMKey is an LPM trie key as the map holds it.
type rawLPMKey[K any] interface {
	prefix() trieKey
	// withPrefix is the key of this layout holding p (the receiver's fields are not used).
	withPrefix(p trieKey) K
}

func (k masqLpm4Key) prefix() trieKey {
	return netip.PrefixFrom(netip.AddrFrom4(k.Addr), int(k.Prefixlen))
}

func (k masqLpm6Key) prefix() trieKey {
	return netip.PrefixFrom(netip.AddrFrom16(k.Addr), int(k.Prefixlen))
}

func (masqLpm4Key) withPrefix(p trieKey) masqLpm4Key {
	return masqLpm4Key{Prefixlen: uint32(p.Bits()), Addr: p.Addr().As4()}
}

func (masqLpm6Key) withPrefix(p trieKey) masqLpm6Key {
	return masqLpm6Key{Prefixlen: uint32(p.Bits()), Addr: p.Addr().As16()}
}

// rawLPMVal is an LPM trie value as the map holds it.
type rawLPMVal[V any] interface {
	value() trieValue
	// withValue is the value of this layout holding v (the receiver's fields are not used).
	withValue(v trieValue) V
}

// An all-zero snat is none (neither family's unspecified address can be a masquerade address).
func (v masqLpm4Val) value() trieValue {
	tv := trieValue{action: policy.Action(v.Action), slot: v.Slot}
	if v.Snat != ([4]byte{}) {
		tv.snat = netip.AddrFrom4(v.Snat)
	}
	return tv
}

func (v masqLpm6Val) value() trieValue {
	tv := trieValue{action: policy.Action(v.Action), slot: v.Slot}
	if v.Snat != ([16]byte{}) {
		tv.snat = netip.AddrFrom16(v.Snat)
	}
	return tv
}

func (masqLpm4Val) withValue(v trieValue) masqLpm4Val {
	val := masqLpm4Val{Slot: v.slot, Action: masqAction(v.action)}
	if v.snat.IsValid() {
		val.Snat = v.snat.Unmap().As4()
	}
	return val
}

func (masqLpm6Val) withValue(v trieValue) masqLpm6Val {
	val := masqLpm6Val{Slot: v.slot, Action: masqAction(v.action)}
	if v.snat.IsValid() {
		val.Snat = v.snat.As16()
	}
	return val
}

// lpmOps implements trieOps for the key layout K and value layout V.
type lpmOps[K rawLPMKey[K], V rawLPMVal[V]] struct{}

func (lpmOps[K, V]) keys(prefixes []trieKey) []K {
	var zero K
	keys := make([]K, len(prefixes))
	for i, p := range prefixes {
		keys[i] = zero.withPrefix(p)
	}
	return keys
}

func (lpmOps[K, V]) read(m *ebpf.Map, fn func(trieKey, trieValue)) error {
	return eachEntry(m, func(k K, v *V) { fn(k.prefix(), (*v).value()) })
}

func (o lpmOps[K, V]) put(m *ebpf.Map, entries []trieEntry) error {
	var (
		zk K
		zv V
	)
	keys, vals := make([]K, len(entries)), make([]V, len(entries))
	for i, e := range entries {
		keys[i], vals[i] = zk.withPrefix(e.prefix), zv.withValue(e.trieValue)
	}
	return putAll(m, keys, vals)
}

func (o lpmOps[K, V]) delete(m *ebpf.Map, prefixes []trieKey) error {
	_, err := deleteAll(m, o.keys(prefixes))
	return err
}

func (lpmOps[K, V]) walk(m *ebpf.Map) trieWalk { return &lpmWalk[K, V]{mapReader: mapReader{m: m}} }

// lpmWalk implements trieWalk with a mapReader.
type lpmWalk[K rawLPMKey[K], V rawLPMVal[V]] struct {
	mapReader
	keys []K
	vals []V
}

func (w *lpmWalk[K, V]) next(max int) ([]trieEntry, bool, error) {
	if len(w.keys) < max {
		w.keys, w.vals = make([]K, max), make([]V, max)
	}
	n, over, err := readInto(&w.mapReader, w.keys[:max], w.vals[:max])
	if err != nil {
		return nil, false, err
	}
	entries := make([]trieEntry, n)
	for i := range n {
		entries[i] = trieEntry{w.keys[i].prefix(), w.vals[i].value()}
	}
	return entries, over || n == 0, nil
}

// trieChunk is how many entries a sync writes into a trie at a time where it deletes the stale
// prefixes as the writes pass them (passingSteps); a variable for tests.
var trieChunk = 2048

// trieStep is a step of a trie's sync: entries to write, then prefixes to delete.
type trieStep struct {
	put []trieEntry
	del []trieKey
}

// passingSteps splits the sync of a trie into steps of up to chunk entries of put, each followed
// by the deletion of the prefixes of stale that no entry still to come overlaps (both lists in
// prefixOrder, put's by address): every address of such a prefix has its new longest match in
// the trie already (a prefix that contains it came before it, one it contains was written with
// it), so the deletion opens no gap, and a swap of 100k prefixes drops an old one milliseconds
// into the writes rather than after all of them. The last step deletes what is left. The steps
// are made as they are taken, so that the first is written before the rest are worked out;
// they reorder stale, which is theirs.
func passingSteps(put []trieEntry, stale []trieKey, chunk int) iter.Seq[trieStep] {
	return func(yield func(trieStep) bool) {
		// waiting are the stale prefixes before the next entry's address that contain it: a
		// chain of nested prefixes, a few at most. The others a step deletes it gathers in
		// place at the front of what is left of stale: a step of a swap of 100k prefixes may
		// delete them all, and copies of them would cost more than the first writes.
		var waiting []trieKey
		for len(put) > chunk {
			step := trieStep{put: put[:chunk]}
			put = put[chunk:]
			next := put[0].prefix.Addr()
			kept := waiting[:0]
			for _, p := range waiting {
				if lastAddr(p).Less(next) {
					step.del = append(step.del, p)
				} else {
					kept = append(kept, p)
				}
			}
			waiting = kept
			done := 0 // stale[:done] are deleted in this step
			i := 0
			for ; i < len(stale) && stale[i].Addr().Less(next); i++ {
				if p := stale[i]; lastAddr(p).Less(next) {
					stale[done] = p
					done++
				} else {
					waiting = append(waiting, p)
				}
			}
			if step.del == nil {
				step.del = stale[:done:done]
			} else {
				step.del = append(step.del, stale[:done]...)
			}
			stale = stale[i:]
			if !yield(step) {
				return
			}
		}
		yield(trieStep{put: put, del: append(waiting, stale...)})
	}
}

// lastAddr is the last address of p (without the allocation of a byte slice: a swap of 100k
// prefixes asks for each).
func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr()
	if a.Is4() {
		b := a.As4()
		v := binary.BigEndian.Uint32(b[:]) | uint32(math.MaxUint32>>p.Bits()) // Go: >>32 is 0
		binary.BigEndian.PutUint32(b[:], v)
		return netip.AddrFrom4(b)
	}
	b := a.As16()
	hi, lo := binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])
	if bits := p.Bits(); bits < 64 {
		hi, lo = hi|math.MaxUint64>>bits, math.MaxUint64
	} else {
		lo |= math.MaxUint64 >> (bits - 64)
	}
	binary.BigEndian.PutUint64(b[:8], hi)
	binary.BigEndian.PutUint64(b[8:], lo)
	return netip.AddrFrom16(b)
}

// replacePassing writes put and deletes stale in passingSteps.
func (t *trie) replacePassing(put []trieEntry, stale []trieKey) error {
	for s := range passingSteps(put, stale, trieChunk) {
		if err := t.put(s.put); err != nil {
			return err
		}
		if err := t.delete(s.del); err != nil {
			return err
		}
	}
	return nil
}
