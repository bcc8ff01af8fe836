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
	type key struct {
		proto uint8
		table Table
		state FlowState
	}
	counts := map[key]uint64{}
	if err := d.natTable(fam).count(func(proto uint8, tbl Table, f Flags) {
		st := StateKept
		if tbl != TableKeep {
			st = StateOf(f, 0)
		}
		counts[key{proto, tbl, st}]++
	}); err != nil {
		return nil, fmt.Errorf("read %s nat table: %w", fam, err)
	}
	out := make([]NATCount, 0, len(counts))
	for k, n := range counts {
		out = append(out, NATCount{Proto: k.proto, Table: k.table, State: k.state, N: n})
	}
	slices.SortFunc(out, func(a, b NATCount) int {
		return cmp.Or(cmp.Compare(a.Proto, b.Proto), cmp.Compare(a.Table, b.Table), cmp.Compare(a.State, b.State))
	})
	return out, nil
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
	for _, kt := range keys {
		k := K.withTuple(*new(K), kt)
		for _, m := range t.tables() {
			if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
		}
	}
	return nil
}
