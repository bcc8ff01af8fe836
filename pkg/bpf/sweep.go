package bpf

import (
	"errors"
	"fmt"
	"sync"
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
// key taken over) expires by its own. It is a SweepPass taken in one step.
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
func (d *Datapath) Sweep(now time.Duration, t Timeouts) (SweepResult, error) {
	p := d.NewSweep(now, t)
	_, err := p.Step(now, nil)
	return p.Result(), err
}

// A SweepPass is a sweep (Sweep) taken in steps, each going on from where the last stopped, so
// that the walk of a large table can be spread over many ticks and cost little in any of them.
// The walk's cursor is a bucket index (mapReader): an entry that stays in the table is read once
// however long the pass takes; one made or changed after its bucket was read is left to the next
// pass, which SweepResult.Due accounts for from the pass's start.
type SweepPass struct {
	d     *Datapath
	t     Timeouts
	start time.Duration
	res   SweepResult
	fam   int      // the families swept so far, IPv4 first; the held fragments after both
	cur   natSweep // the family under way's sweep, nil before it begins
	tt    Timeouts // its timeouts: t, with closing flows' shorter under pressure
	c     *census  // its census
	from  uint64   // the datapath's count of confirmed flows when it began
}

var sweepFamilies = policy.Families()

// NewSweep begins a sweep pass at now (MonotonicNow) that judges by t.
func (d *Datapath) NewSweep(now time.Duration, t Timeouts) *SweepPass {
	p := &SweepPass{d: d, t: t, start: now}
	p.res.Counts = map[policy.Family][]NATCount{}
	// An entry made or changed after the pass read its place expires no sooner than the
	// shortest timeout after the pass began.
	p.res.Due = now + t.shortestOfAll()
	return p
}

// Step sweeps on from where the pass stopped, at now, until the pass is over (then it tells so)
// or until more, asked after each batch (nil: never), says to stop. After an error the pass is
// to be dropped.
func (p *SweepPass) Step(now time.Duration, more func() bool) (over bool, err error) {
	swept := map[uint8]uint64{}
	defer func() {
		if serr := p.d.addSwept(swept); serr != nil && err == nil {
			err = fmt.Errorf("sweep: %w", serr)
		}
	}()
	for p.fam < len(sweepFamilies) {
		if p.cur == nil {
			if err := p.begin(); err != nil {
				return false, err
			}
		}
		done, err := p.cur.step(now, p.tt, &p.res, p.c, swept)
		if err != nil {
			return false, fmt.Errorf("sweep: %w", err)
		}
		if done {
			p.end()
		}
		if more != nil && !more() {
			return false, nil
		}
	}
	var held int
	p.res.Fragments, held, err = p.d.sweepHeld(now)
	p.res.Urgent = p.res.Urgent || held > 0 // rare, and their times are not read
	return err == nil, err
}

// Result is what the pass removed and left; complete once Step said the pass is over.
func (p *SweepPass) Result() SweepResult { return p.res }

// begin begins the sweep of the next family's tables.
func (p *SweepPass) begin() error {
	fam := sweepFamilies[p.fam]
	from, err := p.d.eventCount(EventConfirmed)
	if err != nil {
		return fmt.Errorf("sweep: %w", err)
	}
	f := &p.d.fill[p.fam]
	p.tt, p.from, p.c = p.t, from, newCensus(&p.res.Due)
	if f.pressed(p.d.Capacity(fam, TableConfirmed)) {
		p.tt.TCPClosing = min(p.tt.TCPClosing, pressureIdle)
		p.res.Due = min(p.res.Due, p.start+p.tt.shortestOfAll())
	}
	p.cur = p.d.natTable(fam).sweeper(f.removedN)
	return nil
}

// end ends the sweep of a family's tables: its census, and its confirmed table's count.
func (p *SweepPass) end() {
	fam := sweepFamilies[p.fam]
	p.res.Counts[fam] = p.c.counts()
	f := &p.d.fill[p.fam]
	f.counted(p.cur.confirmed(), p.from)
	// A table found under pressure, or swept as one, wants the next pass at once.
	p.res.Urgent = p.res.Urgent || p.tt != p.t || f.pressed(p.d.Capacity(fam, TableConfirmed))
	p.fam, p.cur = p.fam+1, nil
}

// tableFill is what the sweep knows of how full a family's confirmed table is: the entries its
// last walk counted, the datapath's count of confirmed flows (EventConfirmed, which moves both
// halves of a flow there) when that walk began, and how many entries the sweep removed from
// it since.
type tableFill struct {
	mu      sync.Mutex
	known   bool
	seen    int
	from    uint64
	removed int
}

func (f *tableFill) counted(seen int, from uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.known, f.seen, f.from, f.removed = true, seen, from, 0
}

func (f *tableFill) removedN(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removed += n
}

// pressed tells whether the last walk found the table, of capacity entries, pressureFill full.
func (f *tableFill) pressed(capacity int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return float64(f.seen) >= pressureFill*float64(capacity)
}

// estimate is how many entries the table may hold now that the datapath has confirmed
// confirmed flows: the last count, plus two entries for each flow confirmed since that walk
// began, less those the sweep removed since it ended. It errs high: the counter is of both
// families, and a flow confirmed during the walk may be counted twice.
func (f *tableFill) estimate(confirmed uint64) (int, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	since := 0
	if confirmed > f.from {
		since = int(confirmed - f.from)
	}
	return f.seen + 2*since - f.removed, f.known
}

// MayBePressed tells whether a family's confirmed table may be pressureFill full by now, as the
// last count of each (the last sweep pass's) and the datapath's counter of confirmed flows since
// tell: one counter read, where a count reads every entry. It errs toward pressure, and says
// nothing before a sweep counted the tables, nor of tables smaller than the default.
func (d *Datapath) MayBePressed() (bool, error) {
	confirmed, err := d.eventCount(EventConfirmed)
	if err != nil {
		return false, err
	}
	for i, fam := range sweepFamilies {
		// The counter is of both families: a table smaller than the default (IPv6's 1024
		// entries without --enable-ipv6) would seem to fill with the other's flows; its count
		// at each pass is what tells.
		capacity := d.Capacity(fam, TableConfirmed)
		n, known := d.fill[i].estimate(confirmed)
		if known && capacity >= DefaultNATEntries && float64(n) >= pressureFill*float64(capacity) {
			return true, nil
		}
	}
	return false, nil
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

// natSweep is a sweep of one family's tables, batch by batch.
type natSweep interface {
	// step sweeps the next batch, and tells whether every table was swept.
	step(now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) (over bool, err error)
	// confirmed is how many entries the walk read in the confirmed table.
	confirmed() int
}

// tableSweep is natSweep for the key layout K: the confirmed table, then the unreplied one, then
// the kept verdicts. gone is told how many entries it removes from the confirmed table.
type tableSweep[K rawNATKey[K]] struct {
	table natTableOf[K]
	gone  func(int)
	at    int // the table being swept: a Table, then the keep table (2)
	flows *mapWalk[K, masqNatEntry]
	keep  *mapWalk[K, masqKeepEntry]
	read  int // entries read in the confirmed table
	// A batch's scratch: the keys to delete by table, the expired flows, the verdicts.
	doomed     [2][]K
	dflows     []doomedFlow
	doomedKept []K
}

func (table natTableOf[K]) sweeper(gone func(int)) natSweep {
	return &tableSweep[K]{table: table, gone: gone, flows: newMapWalk[K, masqNatEntry](table.confirmed, natBatch)}
}

func (s *tableSweep[K]) confirmed() int { return s.read }

func (s *tableSweep[K]) step(now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) (bool, error) {
	if s.at == 2 {
		if s.keep == nil {
			s.keep = newMapWalk[K, masqKeepEntry](s.table.keep, natBatch)
		}
		n, over, err := s.keep.next()
		res.Read += n
		if err == nil && n > 0 {
			err = s.sweepKeep(s.keep.keys[:n], s.keep.vals[:n], now, t, res, c, swept)
		}
		return over && err == nil, err
	}
	tbl := Table(s.at)
	n, over, err := s.flows.next()
	if err == nil && n > 0 {
		res.Read += n
		if tbl == TableConfirmed {
			s.read += n
		}
		err = s.sweepBatch(tbl, s.flows.keys[:n], s.flows.vals[:n], now, t, res, c, swept)
	}
	if err != nil || !over {
		return false, err
	}
	if s.at++; s.at < 2 {
		s.flows.restart(s.table.unreplied)
	}
	return false, nil
}

// mayExpire tells whether a half of a flow of proto, with flags, idle since lastSeen, may have
// expired at now: it has been idle for the timeout of the state its own flags tell. Only such
// halves are looked at further; a half the datapath gave a state's flags that its partner lacks
// (both get them, but for an instant) is judged from the partner.
func (t Timeouts) mayExpire(proto uint8, flags Flags, lastSeen uint64, now time.Duration) bool {
	return now-time.Duration(lastSeen) > t.timeout(proto, StateOf(flags, 0))
}

// sweepBatch sweeps a batch of entries read from one flow table (tbl).
func (s *tableSweep[K]) sweepBatch(tbl Table, keys []K, vals []masqNatEntry, now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) error {
	table, m := s.table, s.table.tables()[tbl]
	doomed, flows := s.doomed, s.dflows[:0]
	doomed[0], doomed[1] = doomed[0][:0], doomed[1][:0]
	defer func() { s.doomed, s.dflows = doomed, flows }()
	for i := range keys {
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
			return err
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
			return err
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
	return s.deleteDoomed(tbl, doomed, flows, res, swept)
}

// deleteDoomed deletes a sweep batch's expired flows (doomed, by table; flows, where each one's
// keys are) and counts what went: whole flows, and halves whose partner was gone already
// (orphans), by protocol in swept.
func (s *tableSweep[K]) deleteDoomed(tbl Table, doomed [2][]K, flows []doomedFlow, res *SweepResult, swept map[uint8]uint64) error {
	var gone [2][]bool
	for i, m := range s.table.tables() {
		var err error
		if gone[i], err = deleteAll(m, doomed[i]); err != nil {
			return fmt.Errorf("delete nat entries: %w", err)
		}
	}
	s.gone(trues(gone[TableConfirmed]))
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

// sweepKeep removes, of a batch read from the keep table, the kept verdicts of flows idle for
// longer than their protocol's timeout (a TCP connection's: established, closing once the pod
// sent a FIN or RST).
func (s *tableSweep[K]) sweepKeep(keys []K, vals []masqKeepEntry, now time.Duration, t Timeouts, res *SweepResult, c *census, swept map[uint8]uint64) error {
	doomed := s.doomedKept[:0]
	defer func() { s.doomedKept = doomed }()
	for i := range keys {
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
	gone, err := deleteAll(s.table.keep, doomed)
	if err != nil {
		return fmt.Errorf("delete kept verdicts: %w", err)
	}
	for i, g := range gone {
		if g {
			res.Kept++
			swept[doomed[i].tuple().proto]++
		}
	}
	return nil
}

// trues counts the true ones of bs.
func trues(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
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
