package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"golang.org/x/sys/unix"
)

// The flow tables' part of a migration: entries of an older layout are decoded from their bytes,
// merged into tables the new programs may be writing meanwhile, and their slots renamed.

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
			err = putAll(m, b.keys, b.vals)
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
