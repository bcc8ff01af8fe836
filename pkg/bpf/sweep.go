package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// SweepResult counts what a sweep removed, and what it left.
type SweepResult struct {
	Swept
	// Read is how many entries the sweep read.
	Read int
	// Counts are the entries the sweep left, by family, as CountNAT counts them (each entry by
	// its own flags), as they were when it read them: a table's census at no cost of its own.
	Counts map[policy.Family][]NATCount
	// Due is the earliest time (MonotonicNow's clock) at which an entry the sweep left, or one
	// made or changed since it began, can have been idle for its timeout: a sweep that starts by
	// Due plus an interval removes every flow within that interval of its timeout, as a sweep
	// every interval does.
	Due time.Duration
	// Urgent tells that a table is under pressure (pressureFill) or fragments are held: the
	// next sweep should come an interval later, whatever Due.
	Urgent bool
}

// Swept counts what a sweep removed.
type Swept struct {
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
// It reads the tables in batches and looks further only at entries idle for longer than the
// timeout of the state their own flags tell (the datapath sets a state's flags on both halves):
// a sweep of a table of live or idle established flows costs a few syscalls per batch and no
// memory per entry. An expired flow costs two lookups (its partner, and itself again in case a
// packet refreshed it since the batch was read); entries are deleted a batch at a time. On its
// way it counts what it leaves (SweepResult.Counts) and when the next sweep is due.
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
	res.Counts = map[policy.Family][]NATCount{}
	res.Due = time.Duration(math.MaxInt64)
	for i, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		tt := t
		if float64(d.confirmedSeen[i].Load()) >= pressureFill*float64(d.Capacity(fam, TableConfirmed)) {
			tt.TCPClosing = min(tt.TCPClosing, pressureIdle)
		}
		// An entry made or changed after the sweep read its place expires no sooner than the
		// shortest timeout after that.
		res.Due = min(res.Due, now+tt.shortestOfAll())
		c := newCensus(&res.Due)
		n, err := d.natTable(fam).sweep(now, tt, &res, c, swept)
		if err != nil {
			return res, fmt.Errorf("sweep: %w", err)
		}
		res.Counts[fam] = c.counts()
		d.confirmedSeen[i].Store(int64(n))
		res.Urgent = res.Urgent || tt != t
	}
	var held int
	res.Fragments, held, err = d.sweepHeld(now)
	res.Urgent = res.Urgent || held > 0 // rare, and their times are not read
	return res, err
}

// census counts the entries a sweep leaves, as CountNAT does, and the earliest time one of them
// can expire.
type census struct {
	n   map[natCountKey]uint64
	due *time.Duration
}

type natCountKey struct {
	proto uint8
	table Table
	state FlowState
}

func newCensus(due *time.Duration) *census { return &census{n: map[natCountKey]uint64{}, due: due} }

// left records an entry the sweep leaves in tbl: of proto, in state st (by its own flags), last
// seen at lastSeen, which can expire no sooner than its state's timeout after that.
func (c *census) left(proto uint8, tbl Table, st FlowState, lastSeen uint64, t Timeouts) {
	c.n[natCountKey{proto, tbl, st}]++
	*c.due = min(*c.due, time.Duration(lastSeen)+t.timeout(proto, st))
}

func (c *census) counts() []NATCount { return sortedCounts(c.n) }

// sweep is Sweep on one family's tables; it returns how many entries the confirmed table held.
func (table natTableOf[K]) sweep(now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) (int, error) {
	confirmed := 0
	for i, m := range table.tables() {
		n, err := table.sweepTable(m, Table(i), now, t, res, c, swept)
		if err != nil {
			return 0, err
		}
		if Table(i) == TableConfirmed {
			confirmed = n
		}
	}
	return confirmed, table.sweepKeep(now, t, res, c, swept)
}

// mayExpire tells whether a half of a flow of proto, with flags, idle since lastSeen, may have
// expired at now: it has been idle for the timeout of the state its own flags tell. Only such
// halves are looked at further; a half the datapath gave a state's flags that its partner lacks
// (both get them, but for an instant) is judged from the partner.
func (t Timeouts) mayExpire(proto uint8, flags Flags, lastSeen uint64, now time.Duration) bool {
	return now-time.Duration(lastSeen) > t.timeout(proto, StateOf(flags, 0))
}

// sweepTable sweeps one flow table (tbl) and returns how many entries it read.
func (table natTableOf[K]) sweepTable(m *ebpf.Map, tbl Table, now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) (int, error) {
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
			own := Flags(v.Flags)
			if !t.mayExpire(kt.proto, own, v.LastSeen, now) {
				c.left(kt.proto, tbl, StateOf(own, 0), v.LastSeen, t)
				continue
			}
			pk, pv, paired, ptbl, err := table.lookupPartnerIn(k, v)
			if err != nil {
				inner = err
				return false
			}
			last, partnerFlags := v.LastSeen, Flags(0)
			// A flow is judged once: from its egress half, or from this one when the egress half
			// does not look expired by its own flags (it is counted as it is read, then).
			defers := paired && kt.dir != Egress && t.mayExpire(kt.proto, Flags(pv.Flags), pv.LastSeen, now)
			if defers {
				continue // the egress half judges the flow, and counts this half if it stays
			}
			partnerDefers := paired && kt.dir == Egress && t.mayExpire(kt.proto, Flags(pv.Flags), pv.LastSeen, now)
			if paired {
				last, partnerFlags = max(last, pv.LastSeen), Flags(pv.Flags)
			}
			stays := func() { // the flow, seen last at last
				c.left(kt.proto, tbl, StateOf(own, 0), last, t)
				if partnerDefers {
					c.left(kt.proto, ptbl, StateOf(Flags(pv.Flags), 0), last, t)
				}
			}
			if now-time.Duration(last) <= t.timeout(kt.proto, StateOf(own, partnerFlags)) {
				stays()
				continue
			}
			// A packet may have refreshed the entry since its batch was read.
			if touched, err := touchedSince(m, &keys[i], v.LastSeen); err != nil {
				inner = err
				return false
			} else if touched {
				stays()
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
		if err := table.deleteDoomed(tbl, doomed, flows, res, swept); err != nil {
			inner = err
			return false
		}
		return true
	})
	res.Read += seen
	return seen, cmp.Or(inner, err)
}

// deleteDoomed deletes a sweep batch's expired flows (doomed, by table; flows, where each one's
// keys are) and counts what went: whole flows, and halves whose partner was gone already
// (orphans), by protocol in swept.
func (table natTableOf[K]) deleteDoomed(tbl Table, doomed [2][]K, flows []doomedFlow, res *SweepResult, swept map[uint8]uint64) error {
	var gone [2][]bool
	for i, m := range table.tables() {
		var err error
		if gone[i], err = deleteKeys(m, doomed[i]); err != nil {
			return err
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
	return nil
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
func (table natTableOf[K]) sweepKeep(now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) error {
	var (
		doomed []K
		inner  error
	)
	err := walkNAT(table.keep, func(keys []K, vals []masqKeepEntry, n int) bool {
		doomed = doomed[:0]
		res.Read += n
		for i := range n {
			st, proto := StateKept, keys[i].tuple().proto
			if vals[i].Closing != 0 {
				st = StateClosing
			}
			if now-time.Duration(vals[i].LastSeen) > t.timeout(proto, st) {
				doomed = append(doomed, keys[i])
				continue
			}
			c.n[natCountKey{proto, TableKeep, StateKept}]++
			*c.due = min(*c.due, time.Duration(vals[i].LastSeen)+t.timeout(proto, st))
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
