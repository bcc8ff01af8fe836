package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// SweepResult counts what a sweep removed.
type SweepResult struct {
	Flows     int // flows whose both halves were removed
	Orphans   int // halves whose partner was gone or belonged to another flow
	Kept      int // RETURN verdicts of idle flows (the keep tables)
	Fragments int // held fragments whose first fragment did not come in time (FragHoldTimeout)
}

// Pressure: when a sweep finds a family's table of confirmed flows at least pressureFill full,
// the next sweep expires its closing flows once idle for pressureIdle, whatever TCPClosing says
// (conntrack's early_drop, which goes for closing connections first); established flows keep
// their timeouts.
const (
	pressureFill = 0.9
	pressureIdle = 10 * time.Second
)

// Sweep removes the flows idle for longer than their timeout at time now (MonotonicNow), both
// halves together, from both flow tables of each family, the kept verdicts of idle flows, and
// the held fragments that waited too long for their first fragment (FragHoldTimeout). A
// flow's state and idle time combine its two halves; a half without its partner (evicted, or its
// key taken over) expires by its own.
//
// It reads the tables in batches and looks further only at entries idle for longer than their
// protocol's shortest timeout: a sweep of a busy table costs a few syscalls per batch and no
// memory per entry. An expired flow costs two lookups (its partner, and itself again in case a
// packet refreshed it since the batch was read); entries are deleted a batch at a time.
//
// The entries it removes are added, by protocol, to the totals that SweptEntries reads (kept in
// a map, so that they survive an agent restart); the totals assume one sweeper at a time.
func (d *Datapath) Sweep(now time.Duration, t Timeouts) (res SweepResult, err error) {
	swept := map[uint8]uint64{}
	defer func() {
		if serr := d.addSwept(swept); serr != nil && err == nil {
			err = fmt.Errorf("sweep: %w", serr)
		}
	}()
	for i, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		tt := t
		if float64(d.confirmedSeen[i].Load()) >= pressureFill*float64(d.Capacity(fam, TableConfirmed)) {
			tt.TCPClosing = min(tt.TCPClosing, pressureIdle)
		}
		n, err := d.natTable(fam).sweep(now, tt, &res, swept)
		if err != nil {
			return res, fmt.Errorf("sweep: %w", err)
		}
		d.confirmedSeen[i].Store(int64(n))
	}
	res.Fragments, err = d.sweepHeld(now)
	return res, err
}

// sweep is Sweep on one family's tables; it returns how many entries the confirmed table held.
func (table natTableOf[K]) sweep(now time.Duration, t Timeouts, res *SweepResult, swept map[uint8]uint64) (int, error) {
	confirmed := 0
	for i, m := range table.tables() {
		n, err := table.sweepTable(m, Table(i), now, t, res, swept)
		if err != nil {
			return 0, err
		}
		if Table(i) == TableConfirmed {
			confirmed = n
		}
	}
	return confirmed, table.sweepKeep(now, t, res, swept)
}

// sweepTable sweeps one flow table (tbl) and returns how many entries it read.
func (table natTableOf[K]) sweepTable(m *ebpf.Map, tbl Table, now time.Duration, t Timeouts, res *SweepResult, swept map[uint8]uint64) (int, error) {
	var (
		doomed [2][]K // by table: keys to delete
		flows  []doomedFlow
		inner  error
		seen   int
	)
	err := walkNAT(m, func(keys []K, vals []masqNatEntry, n int) bool {
		seen += n
		doomed[0], doomed[1], flows = doomed[0][:0], doomed[1][:0], flows[:0]
		for i := range n {
			// k is a copy; lookups take &keys[i], which is on the heap already.
			k, v := keys[i], &vals[i]
			kt := k.tuple()
			if now-time.Duration(v.LastSeen) <= t.shortest(kt.proto) {
				continue
			}
			pk, pv, paired, ptbl, err := table.lookupPartnerIn(k, v)
			if err != nil {
				inner = err
				return false
			}
			last, partnerFlags := v.LastSeen, Flags(0)
			if paired {
				if kt.dir != Egress {
					continue // a flow is judged once, from its egress half
				}
				last, partnerFlags = max(last, pv.LastSeen), Flags(pv.Flags)
			}
			if now-time.Duration(last) <= t.timeout(kt.proto, StateOf(Flags(v.Flags), partnerFlags)) {
				continue
			}
			// A packet may have refreshed the entry since its batch was read.
			if touched, err := touchedSince(m, &keys[i], v.LastSeen); err != nil {
				inner = err
				return false
			} else if touched {
				continue
			}
			f := doomedFlow{proto: kt.proto, at: [2]int{-1, -1}}
			f.at[0] = len(doomed[tbl])
			doomed[tbl] = append(doomed[tbl], k)
			if paired {
				f.ptbl, f.at[1] = ptbl, len(doomed[ptbl])
				doomed[ptbl] = append(doomed[ptbl], pk)
			}
			flows = append(flows, f)
		}
		var gone [2][]bool
		for i, mm := range table.tables() {
			var err error
			if gone[i], err = deleteKeys(mm, doomed[i]); err != nil {
				inner = err
				return false
			}
		}
		for _, f := range flows {
			deleted := 0
			if gone[tbl][f.at[0]] {
				deleted++
			}
			if f.at[1] >= 0 && gone[f.ptbl][f.at[1]] {
				deleted++
			}
			swept[f.proto] += uint64(deleted)
			if f.at[1] >= 0 && deleted == 2 {
				res.Flows++
			} else {
				res.Orphans += deleted
			}
		}
		return true
	})
	return seen, cmp.Or(inner, err)
}

// doomedFlow is an expired flow of a sweep batch: where its keys are in the batch's doomed lists
// (its own in the table swept, its partner's, when it has one, in ptbl's; -1 when not).
type doomedFlow struct {
	proto uint8
	ptbl  Table
	at    [2]int
}

// sweepKeep removes the kept verdicts of flows idle for longer than their protocol's timeout (a
// TCP connection's: established, closing once the pod sent a FIN or RST).
func (table natTableOf[K]) sweepKeep(now time.Duration, t Timeouts, res *SweepResult, swept map[uint8]uint64) error {
	var (
		doomed []K
		inner  error
	)
	err := walkNAT(table.keep, func(keys []K, vals []masqKeepEntry, n int) bool {
		doomed = doomed[:0]
		for i := range n {
			st := StateKept
			if vals[i].Closing != 0 {
				st = StateClosing
			}
			if now-time.Duration(vals[i].LastSeen) > t.timeout(keys[i].tuple().proto, st) {
				doomed = append(doomed, keys[i])
			}
		}
		gone, err := deleteKeys(table.keep, doomed)
		if err != nil {
			inner = err
			return false
		}
		for i, g := range gone {
			if g {
				res.Kept++
				swept[doomed[i].tuple().proto]++
			}
		}
		return true
	})
	return cmp.Or(inner, err)
}

// touchedSince reports whether the entry at key changed since it was read with lastSeen: a
// packet refreshed it, or it is gone. The sweep asks before deleting an idle flow.
func touchedSince(m *ebpf.Map, key any, lastSeen uint64) (bool, error) {
	var cur masqNatEntry
	if err := m.Lookup(key, &cur); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return true, nil
		}
		return false, fmt.Errorf("lookup nat entry: %w", err)
	}
	return cur.LastSeen != lastSeen, nil
}

// deleteKeys deletes keys from a NAT table, a batch at a time where the kernel can, and tells
// which it deleted: a key that is gone already (an LRU eviction, another CPU) is skipped.
func deleteKeys[K any](m *ebpf.Map, keys []K) ([]bool, error) {
	gone := make([]bool, len(keys))
	for at := 0; at < len(keys); {
		n, err := m.BatchDelete(keys[at:], nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			for i := at; i < len(keys); i++ {
				err := m.Delete(&keys[i])
				if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return nil, fmt.Errorf("delete nat entry: %w", err)
				}
				gone[i] = err == nil
			}
			return gone, nil
		}
		for i := at; i < at+n; i++ {
			gone[i] = true
		}
		at += n
		switch {
		case err == nil:
		case errors.Is(err, ebpf.ErrKeyNotExist):
			at++ // keys[at] is gone already: go on after it
		default:
			return nil, fmt.Errorf("delete nat entries: %w", err)
		}
	}
	return gone, nil
}

// addSwept adds removed entries by protocol to sweep_stats.
func (d *Datapath) addSwept(swept map[uint8]uint64) error {
	for proto, n := range swept {
		if n == 0 {
			continue
		}
		var total uint64
		if err := d.objs.SweepStats.Lookup(uint32(proto), &total); err != nil {
			return fmt.Errorf("read sweep_stats[%d]: %w", proto, err)
		}
		if err := d.objs.SweepStats.Put(uint32(proto), total+n); err != nil {
			return fmt.Errorf("write sweep_stats[%d]: %w", proto, err)
		}
	}
	return nil
}

// SweptEntries returns how many NAT entries sweeps removed, by IP protocol number, since the
// maps were created. Protocols without removals are left out.
func (d *Datapath) SweptEntries() (map[uint8]uint64, error) {
	out := map[uint8]uint64{}
	if err := eachEntry(d.objs.SweepStats, func(proto uint32, n *uint64) {
		if *n > 0 {
			out[uint8(proto)] = *n
		}
	}); err != nil {
		return nil, fmt.Errorf("read sweep_stats: %w", err)
	}
	return out, nil
}
