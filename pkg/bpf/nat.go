package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Direction says which half of a flow an entry is.
type Direction uint8

const (
	// Egress entries match packets leaving through the uplink by their original tuple.
	Egress = Direction(masqNatDirDIR_EGRESS)
	// Ingress entries match the replies as they arrive.
	Ingress = Direction(masqNatDirDIR_INGRESS)
)

func (d Direction) String() string {
	if d == Ingress {
		return "ingress"
	}
	return "egress"
}

// Kind is the kind of flow an entry belongs to.
type Kind uint8

const (
	// KindMasq is a masqueraded pod flow.
	KindMasq = Kind(masqNatKindNAT_MASQ)
	// KindHost is a host socket's flow on the uplink address: it reserves its port, and is
	// translated only when a pod mapping held that port first.
	KindHost = Kind(masqNatKindNAT_HOST)
	// KindInbound is a connection opened from outside toward a pod: never translated.
	KindInbound = Kind(masqNatKindNAT_INBOUND)
)

func (k Kind) String() string {
	switch k {
	case KindMasq:
		return "masq"
	case KindHost:
		return "host"
	case KindInbound:
		return "inbound"
	}
	return fmt.Sprintf("kind_%d", uint8(k))
}

// Flags are an entry's flow state (bpf/types.h, enum nat_flags).
type Flags uint8

const (
	FlagOrig    = Flags(masqNatFlagsNAT_F_ORIG)    // this half's direction opened the flow
	FlagFIN     = Flags(masqNatFlagsNAT_F_FIN)     // a FIN the receiver would accept went either way
	FlagRST     = Flags(masqNatFlagsNAT_F_RST)     // an RST the receiver would accept went either way
	FlagReplied = Flags(masqNatFlagsNAT_F_REPLIED) // the flow has carried a reply
	FlagACK     = Flags(masqNatFlagsNAT_F_ACK)     // TCP: the half holds its direction's latest ACK
	FlagNoRoom  = Flags(masqNatFlagsNAT_F_NOROOM)  // the confirmed table was full when the flow proved two-way
)

// Table says which of a family's tables holds an entry (bpf/nat.h has the design).
type Table uint8

const (
	// TableConfirmed holds the flows that proved two-way; nothing evicts them.
	TableConfirmed Table = iota
	// TableUnreplied holds the flows still being opened; the least recently used are evicted.
	TableUnreplied
	// TableKeep holds the RETURN verdicts of pod flows, TCP connections included.
	TableKeep
)

func (t Table) String() string {
	switch t {
	case TableConfirmed:
		return "confirmed"
	case TableUnreplied:
		return "unreplied"
	case TableKeep:
		return "keep"
	}
	return fmt.Sprintf("table_%d", uint8(t))
}

// Tables lists every table of a family.
func Tables() []Table { return []Table{TableConfirmed, TableUnreplied, TableKeep} }

// NATEntry is one half of a flow, as the NAT table holds it.
type NATEntry struct {
	Dir   Direction
	Proto uint8
	// Src and Dst are the key: the tuple of the packets this entry matches. For ICMP echo the
	// identifier is the request's source port and the reply's destination port.
	Src, Dst netip.AddrPort
	// To is the translation: the new source of egress packets, the new destination of ingress
	// packets. It equals the key's side for untranslated (host, inbound) flows.
	To    netip.AddrPort
	Kind  Kind
	Flags Flags
	Table Table
	Slot  uint32 // counter slot of the deciding rule (masqueraded flows)
	// LastSeen is CLOCK_MONOTONIC time (see MonotonicNow), refreshed at most once a second.
	LastSeen time.Duration
}

// MonotonicNow is the clock of NATEntry.LastSeen (bpf_ktime_get_ns).
func MonotonicNow() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(fmt.Sprintf("clock_gettime(CLOCK_MONOTONIC): %v", err)) // cannot fail on Linux
	}
	return time.Duration(ts.Nano())
}

// NATEntries calls fn for every entry of a family's flow tables (confirmed, then unreplied),
// until fn returns false. The tables change under the walk: an entry added or removed meanwhile
// may be missed, and one the datapath confirms meanwhile may be seen twice.
func (d *Datapath) NATEntries(fam policy.Family, fn func(NATEntry) bool) error {
	if err := d.natTable(fam).entries(fn); err != nil {
		return fmt.Errorf("read %s nat table: %w", fam, err)
	}
	return nil
}

func (t natTableOf[K]) entries(fn func(NATEntry) bool) error {
	return t.each(func(k K, v *masqNatEntry, tbl Table) bool {
		e := k.tuple().decode(v)
		e.Table = tbl
		return fn(e)
	})
}

// NATCount is a number of entries of one kind.
type NATCount struct {
	Proto uint8
	Table Table
	State FlowState // StateKept for the keep table
	N     uint64
}

// CountNAT counts a family's entries by protocol, table and state (each entry by its own flags:
// the datapath sets the state's flags on both halves), without decoding them: what a metrics
// scrape needs, at a few syscalls for a full table.
func (d *Datapath) CountNAT(fam policy.Family) ([]NATCount, error) {
	counts := map[natCountKey]uint64{}
	if err := d.natTable(fam).count(func(proto uint8, tbl Table, f Flags) {
		st := StateKept
		if tbl != TableKeep {
			st = StateOf(f, 0)
		}
		counts[natCountKey{proto, tbl, st}]++
	}); err != nil {
		return nil, fmt.Errorf("read %s nat table: %w", fam, err)
	}
	return sortedCounts(counts), nil
}

// sortedCounts lists counts by protocol, table and state.
func sortedCounts(counts map[natCountKey]uint64) []NATCount {
	out := make([]NATCount, 0, len(counts))
	for k, n := range counts {
		out = append(out, NATCount{Proto: k.proto, Table: k.table, State: k.state, N: n})
	}
	slices.SortFunc(out, func(a, b NATCount) int {
		return cmp.Or(cmp.Compare(a.Proto, b.Proto), cmp.Compare(a.Table, b.Table), cmp.Compare(a.State, b.State))
	})
	return out
}

func (t natTableOf[K]) count(fn func(proto uint8, table Table, flags Flags)) error {
	if err := t.each(func(k K, v *masqNatEntry, tbl Table) bool {
		fn(k.tuple().proto, tbl, Flags(v.Flags))
		return true
	}); err != nil {
		return err
	}
	return walkNAT(t.keep, func(keys []K, _ []masqKeepEntry, n int) bool {
		for i := range n {
			fn(keys[i].tuple().proto, TableKeep, 0)
		}
		return true
	})
}

// Capacity is how many entries a family's table can hold.
func (d *Datapath) Capacity(fam policy.Family, tbl Table) int {
	return int(d.natTable(fam).maxEntries(tbl))
}

func (t natTableOf[K]) maxEntries(tbl Table) uint32 {
	switch tbl {
	case TableConfirmed:
		return t.confirmed.MaxEntries()
	case TableUnreplied:
		return t.unreplied.MaxEntries()
	}
	return t.keep.MaxEntries()
}

// LookupNAT returns the entry with the given key from either flow table, or false.
func (d *Datapath) LookupNAT(dir Direction, proto uint8, src, dst netip.AddrPort) (NATEntry, bool, error) {
	fam := policy.FamilyOf(src.Addr())
	e, ok, err := d.natTable(fam).lookupEntry(keyTuple(dir, proto, src, dst))
	if err != nil {
		return NATEntry{}, false, fmt.Errorf("lookup %s nat entry: %w", fam, err)
	}
	return e, ok, nil
}

func (t natTableOf[K]) lookupEntry(kt natTuple) (NATEntry, bool, error) {
	k := K.withTuple(*new(K), kt)
	var v masqNatEntry
	found, confirmed, err := t.lookup(&k, &v)
	if err != nil || !found {
		return NATEntry{}, false, err
	}
	e := kt.decode(&v)
	if !confirmed {
		e.Table = TableUnreplied
	}
	return e, true, nil
}

// deleteEntries deletes entries by key from both flow tables; entries already gone are fine.
func (d *Datapath) deleteEntries(fam policy.Family, entries []NATEntry) error {
	keys := make([]natTuple, len(entries))
	for i, e := range entries {
		keys[i] = keyTuple(e.Dir, e.Proto, e.Src, e.Dst)
	}
	if err := d.natTable(fam).deleteKeys(keys); err != nil {
		return fmt.Errorf("delete %s nat entry: %w", fam, err)
	}
	return nil
}

func (t natTableOf[K]) deleteKeys(keys []natTuple) error {
	ks := make([]K, len(keys))
	for i, kt := range keys {
		ks[i] = K.withTuple(*new(K), kt)
	}
	for _, m := range t.tables() {
		if _, err := deleteAll(m, ks); err != nil {
			return err
		}
	}
	return nil
}

// The NAT tables as the maps hold them: keys of two layouts (masqNat4Key, masqNat6Key) over one
// value (masqNatEntry), and the walk that reads them in batches. Everything that reads the
// tables goes through natTuple, so that a key's fields, a flow's partner and what the datapath
// calls "points back" are written once for both families (bpf/flow.h has the C side), and a
// NATEntry is only what decode makes of them.

// natTuple is a NAT key's fields, for either family (IPv4 in the first 4 bytes of src and dst);
// addresses and ports in network byte order, as the key holds them.
type natTuple struct {
	v6           bool
	dir          Direction
	proto        uint8
	src, dst     [16]byte
	sport, dport uint16
}

// rawNATKey is a NAT table key as the map holds it (masqNat4Key, masqNat6Key).
type rawNATKey[K any] interface {
	comparable
	tuple() natTuple
	// withTuple is the key of this layout holding t (the receiver's fields are not used).
	withTuple(t natTuple) K
}

func (k masqNat4Key) tuple() natTuple {
	t := natTuple{dir: Direction(k.Dir), proto: k.Proto, sport: k.Sport, dport: k.Dport}
	copy(t.src[:], k.Saddr[:])
	copy(t.dst[:], k.Daddr[:])
	return t
}

func (k masqNat6Key) tuple() natTuple {
	return natTuple{v6: true, dir: Direction(k.Dir), proto: k.Proto, src: k.Saddr, dst: k.Daddr,
		sport: k.Sport, dport: k.Dport}
}

func (masqNat4Key) withTuple(t natTuple) masqNat4Key {
	return masqNat4Key{Saddr: [4]byte(t.src[:4]), Daddr: [4]byte(t.dst[:4]), Sport: t.sport, Dport: t.dport, Proto: t.proto, Dir: masqNatDir(t.dir)}
}

func (masqNat6Key) withTuple(t natTuple) masqNat6Key {
	return masqNat6Key{Saddr: t.src, Daddr: t.dst, Sport: t.sport, Dport: t.dport, Proto: t.proto, Dir: masqNatDir(t.dir)}
}

// keyTuple is the tuple of an entry's key (dir, proto, src, dst).
func keyTuple(dir Direction, proto uint8, src, dst netip.AddrPort) natTuple {
	return natTuple{v6: !src.Addr().Is4(), dir: dir, proto: proto, src: addrBytes(src.Addr()), dst: addrBytes(dst.Addr()),
		sport: htons(src.Port()), dport: htons(dst.Port())}
}

// key is the map key holding t, of its family's layout.
func (t natTuple) key() any {
	if t.v6 {
		return masqNat6Key{}.withTuple(t)
	}
	return masqNat4Key{}.withTuple(t)
}

// natKey is the map key of an entry's (dir, proto, src, dst).
func natKey(dir Direction, proto uint8, src, dst netip.AddrPort) any {
	return keyTuple(dir, proto, src, dst).key()
}

// decode is the entry v found under t.
func (t natTuple) decode(v *masqNatEntry) NATEntry {
	return NATEntry{
		Dir: t.dir, Proto: t.proto,
		Src:  netip.AddrPortFrom(bytesAddr(t.v6, t.src), ntohs(t.sport)),
		Dst:  netip.AddrPortFrom(bytesAddr(t.v6, t.dst), ntohs(t.dport)),
		To:   netip.AddrPortFrom(bytesAddr(t.v6, v.Addr), ntohs(v.Port)),
		Kind: Kind(v.Kind), Flags: Flags(v.Flags), Slot: v.Slot,
		LastSeen: time.Duration(v.LastSeen),
	}
}

// partner is the key of the other half of the flow whose entry v sits at t (C: partner_key):
//
//	egress  {s, d, sp, dp} -> {A, P}  partner: ingress {d, A, dp, P}
//	ingress {s, d, sp, dp} -> {A, P}  partner: egress  {A, s, P, sp}
func (t natTuple) partner(v *masqNatEntry) natTuple {
	p := natTuple{v6: t.v6, proto: t.proto}
	if t.dir == Egress {
		p.dir, p.src, p.dst, p.sport, p.dport = Ingress, t.dst, v.Addr, t.dport, v.Port
	} else {
		p.dir, p.src, p.dst, p.sport, p.dport = Egress, v.Addr, t.src, v.Port, t.sport
	}
	return p
}

// pointedBy tells whether pv, found at t's partner key, is the other half of t's flow rather
// than of a flow that took the key over after an eviction (C: points_back): its translation
// leads back to t's own side.
func (t natTuple) pointedBy(pv *masqNatEntry) bool {
	addr, port := t.src, t.sport
	if t.dir == Ingress {
		addr, port = t.dst, t.dport
	}
	if !t.v6 {
		return [4]byte(pv.Addr[:4]) == [4]byte(addr[:4]) && pv.Port == port
	}
	return pv.Addr == addr && pv.Port == port
}

// lookupPartner reads the other half of the flow whose entry v sits at k, from either table
// (confirmed first, as the datapath looks). ok is false when that half is gone or belongs to
// another flow.
func (t natTableOf[K]) lookupPartner(k K, v *masqNatEntry) (pk K, pv masqNatEntry, ok bool, err error) {
	pk, pv, ok, _, err = t.lookupPartnerIn(k, v)
	return pk, pv, ok, err
}

// lookupPartnerIn is lookupPartner that also tells which table holds the partner.
func (t natTableOf[K]) lookupPartnerIn(k K, v *masqNatEntry) (pk K, pv masqNatEntry, ok bool, tbl Table, err error) {
	kt := k.tuple()
	pk = k.withTuple(kt.partner(v))
	found, confirmed, err := t.lookup(&pk, &pv)
	if err != nil || !found {
		return pk, pv, false, 0, err
	}
	tbl = TableUnreplied
	if confirmed {
		tbl = TableConfirmed
	}
	return pk, pv, kt.pointedBy(&pv), tbl, nil
}

// lookup reads the entry at k from either table, confirmed first, and tells which held it.
func (t natTableOf[K]) lookup(k *K, v *masqNatEntry) (found, confirmed bool, err error) {
	for i, m := range t.tables() {
		err := m.Lookup(k, v)
		if err == nil {
			return true, i == 0, nil
		}
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return false, false, fmt.Errorf("lookup nat entry: %w", err)
		}
	}
	return false, false, nil
}

// natTable is one family's NAT tables, wrapped with the operations of its key layout.
type natTable interface {
	natMigrator
	tables() [2]*ebpf.Map
	entries(fn func(NATEntry) bool) error
	count(fn func(proto uint8, table Table, flags Flags)) error
	flows(fn func(Flow) bool) error
	sweeper(gone func(int)) natSweep
	lookupEntry(t natTuple) (NATEntry, bool, error)
	deleteKeys(keys []natTuple) error
	maxEntries(tbl Table) uint32
}

// natTableOf implements natTable for the key layout K: a family's tables of confirmed and of
// unreplied flows (both halves of a flow are in the same one, but for a moment while the
// datapath confirms it) and its table of kept RETURN verdicts.
type natTableOf[K rawNATKey[K]] struct{ confirmed, unreplied, keep *ebpf.Map }

// tables are the flow tables, confirmed first.
func (t natTableOf[K]) tables() [2]*ebpf.Map { return [2]*ebpf.Map{t.confirmed, t.unreplied} }

func (d *Datapath) natTable(fam policy.Family) natTable {
	if fam == policy.IPv6 {
		return natTableOf[masqNat6Key]{d.objs.NatV6, d.objs.NatNewV6, d.objs.KeepV6}
	}
	return natTableOf[masqNat4Key]{d.objs.NatV4, d.objs.NatNewV4, d.objs.KeepV4}
}

// natBatch is how many entries one batch lookup reads: a full default table (262144 entries)
// is then 64 syscalls, and the buffers stay a few hundred KiB.
const natBatch = 4096

// walkNAT calls fn with the entries of a NAT table a batch at a time, until fn returns false:
// keys[:n] and vals[:n] hold the batch, valid only during the call (see mapReader).
func walkNAT[K, V any](m *ebpf.Map, fn func(keys []K, vals []V, n int) bool) error {
	return newMapWalk[K, V](m, natBatch).each(fn)
}

// each is walkNAT over both flow tables, confirmed first, one entry at a time.
func (t natTableOf[K]) each(fn func(K, *masqNatEntry, Table) bool) error {
	for i, m := range t.tables() {
		stop := false
		err := walkNAT(m, func(keys []K, vals []masqNatEntry, n int) bool {
			for j := range n {
				if !fn(keys[j], &vals[j], Table(i)) {
					stop = true
					return false
				}
			}
			return true
		})
		if err != nil || stop {
			return err
		}
	}
	return nil
}
