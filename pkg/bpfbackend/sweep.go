package bpfbackend

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The sweep, and what it tells the rest of the backend. Every SweepInterval the loop checks the
// former uplinks that drain, and walks the NAT tables when a walk is due (then trims the ports of
// earlier --to-ports ranges, which reads the tables too). A walk reads every entry, some 400-550
// ns each on a VM (the entries are spread over hundreds of MiB): 110 ms for a table of the
// default size, more than a second for 2M entries (1M flows).
//
// Tables of the default size or smaller are walked whole every interval, as they always were. In
// larger ones a walk (a bpf.SweepPass) is paced: each tick walks on where the last stopped for
// at most SweepInterval/sweepDuty, so that the walks take at most 1/sweepDuty of a CPU in any
// stretch of time, not only on average: a table of 2M entries, 1.1 s to read, is walked in 12
// slices of 100 ms, one every 10 s, and a flow may outlive its timeout by that much, as
// conntrack's own garbage collection leaves expired connections until its next scan. A walk says
// when the first flow it left can expire, and a flow made or changed after it began can expire no
// sooner than the shortest timeout after that (bpf.SweepResult.Due): the next walk begins at the
// first tick after that (with the default timeouts, ICMP's 30 s the shortest, at once after a
// paced walk of 2M entries). A table under pressure, or held fragments, make the walks come whole
// every interval again (bpf.SweepResult.Urgent), and so do timeouts that changed. A table that
// fills between counts is noticed at the next tick: each tick asks the datapath's counter of
// confirmed flows whether the table may be 90% full by now (bpf.Datapath.MayBePressed), and then
// walks the rest at once, which counts it.
//
// The walk counts what it leaves, by protocol, table and state (its census): in large tables the
// NAT metrics report that, so that a scrape reads none of the table (the counts are then as old
// as the last walk); smaller ones a scrape counts itself.

// sweepDuty is how many times the time a tick spends walking a large table its interval is.
const sweepDuty = 100

// census is what the last walk counted, and how many entries it read.
type census struct {
	counts map[policy.Family][]bpf.NATCount
	read   int
}

// largeTables is how many entries a walk reads, at least, in tables larger than the default:
// only there are the walks paced and do the metrics report the census.
const largeTables = bpf.DefaultNATEntries + 1

// sweepState is what the sweep loop keeps from tick to tick.
type sweepState struct {
	held     int           // ports of earlier --to-ports ranges held, as last logged
	timeouts bpf.Timeouts  // as last logged
	walked   *bpf.Datapath // the datapath the last walk, or the one under way, is of
	with     bpf.Timeouts  // the timeouts it judges by
	due      time.Time     // when the next walk is due
	pass     *bpf.SweepPass
	paced    bool          // the walk under way goes on a slice per tick
	start    time.Time     // when it began
	mono     time.Duration // that on MonotonicNow's clock
	took     time.Duration // its steps' time so far
}

// sweepLoop expires idle NAT entries until ctx ends.
func (b *Backend) sweepLoop(ctx context.Context) {
	t := time.NewTicker(b.opts.SweepInterval)
	defer t.Stop()
	var s sweepState
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-b.sweepNow:
		}
		if dp := b.dp.Load(); dp != nil {
			b.sweepTick(ctx, &s, dp)
		}
	}
}

// sweepTick is one tick of the loop: a walk begun or gone on with, when one is due, and the
// former uplinks that drain checked, their flows counted once a walk is over.
func (b *Backend) sweepTick(ctx context.Context, s *sweepState, dp *bpf.Datapath) {
	// Shorter timeouts (a sysctl changed) may have expired flows the last walk left, and another
	// datapath has other tables: a walk begins at once, whole.
	if now := b.timeouts(&s.timeouts); dp != s.walked || now != s.with {
		s.walked, s.with, s.pass, s.paced, s.due = dp, now, nil, false, time.Time{}
	}
	if s.pass == nil && !time.Now().Before(s.due) {
		s.start, s.mono, s.took = time.Now(), bpf.MonotonicNow(), 0
		s.pass = dp.NewSweep(s.mono, s.with)
	}
	if s.pass == nil {
		b.checkDraining(ctx, dp, false)
		return
	}
	over, err := b.sweepStep(s, dp)
	if err != nil {
		b.log.Warn("NAT sweep failed", "error", err)
		s.pass = nil // begun again at the next tick
		return
	}
	if !over {
		b.checkDraining(ctx, dp, false)
		return
	}
	b.walkOver(s)
	// Trimming reads every entry too (when ports are held at all): as often as the walks.
	s.held = b.trimHeldPorts(dp, s.held)
	b.checkDraining(ctx, dp, true)
}

// sweepStep goes on with the walk under way: at most SweepInterval/sweepDuty when it is paced
// and no table may be under pressure, else to its end. It tells whether the walk is over.
func (b *Backend) sweepStep(s *sweepState, dp *bpf.Datapath) (bool, error) {
	t0 := time.Now()
	var more func() bool
	if s.paced {
		if pressed, err := dp.MayBePressed(); err != nil || pressed {
			b.log.Debug("a NAT table may be filling: the walk goes on to its end", "error", err)
			s.paced = false
		} else {
			until := t0.Add(b.opts.SweepInterval / sweepDuty)
			more = func() bool { return time.Now().Before(until) }
		}
	}
	over, err := s.pass.Step(bpf.MonotonicNow(), more)
	s.took += time.Since(t0)
	return over, err
}

// walkOver publishes the census of the walk that is over, and sets when the next is due and
// whether it is paced.
func (b *Backend) walkOver(s *sweepState) {
	res, large := s.pass.Result(), cmp.Or(b.largeTables, largeTables)
	b.census.Store(&census{counts: res.Counts, read: res.Read})
	s.due, s.paced, s.pass = nextWalk(s.start, s.mono, res, large), res.Read >= large && !res.Urgent, nil
	msg := "NAT walk" // removed no flow
	if res.Flows > 0 || res.Orphans > 0 || res.Fragments > 0 {
		msg = "NAT sweep"
	}
	b.log.Debug(msg, "flows", res.Flows, "orphanEntries", res.Orphans, "keptVerdicts", res.Kept,
		"heldFragments", res.Fragments, "entriesRead", res.Read, "took", s.took,
		"lasted", time.Since(s.start).Round(time.Millisecond), "nextWalkIn", time.Until(s.due).Round(time.Millisecond))
}

// nextWalk is when the walk that began at start (mono on MonotonicNow's clock) and found res
// wants the next: in large tables (large: read at least that many entries) when res is due; at
// once in small tables, and when res is urgent.
func nextWalk(start time.Time, mono time.Duration, res bpf.SweepResult, large int) time.Time {
	if res.Urgent || res.Read < large {
		return start
	}
	return start.Add(res.Due - mono)
}

// sweepSoon makes the loop walk the tables at once (a datapath was loaded), unless a walk is asked
// for already.
func (b *Backend) sweepSoon() {
	select {
	case b.sweepNow <- struct{}{}:
	default:
	}
}

// counted counts a family of dp's tables for the metrics: as the last walk counted it when that
// read largeTables (b.largeTables in tests), else now.
func (b *Backend) counted(dp *bpf.Datapath) func(policy.Family) ([]bpf.NATCount, error) {
	c := b.census.Load()
	if c == nil || c.read < cmp.Or(b.largeTables, largeTables) {
		return dp.CountNAT
	}
	return func(fam policy.Family) ([]bpf.NATCount, error) { return c.counts[fam], nil }
}

// timeouts are the sweep's timeouts now, from the options and the node's conntrack sysctls
// (bpf.ResolveTimeouts), logged when they differ from *last, which they replace. The sysctls are
// read at every sweep, so that a change of them, or the nf_conntrack module loaded later (by
// kube-proxy), applies here as it applies to conntrack.
func (b *Backend) timeouts(last *bpf.Timeouts) bpf.Timeouts {
	t, from := bpf.ResolveTimeouts(b.opts.Timeouts, cmp.Or(b.opts.ConntrackDir, bpf.ConntrackSysctlDir))
	if t != *last {
		var attrs []any
		for _, k := range bpf.TimeoutKeys {
			attrs = append(attrs, k.Name, fmt.Sprintf("%v (%s)", *k.Of(&t), from[k.Name]))
		}
		b.log.Info("NAT timeouts", attrs...)
		*last = t
	}
	return t
}

// trimHeldPorts lets go of the ports of earlier --to-ports ranges whose flows have ended (see
// bpf.Datapath.TrimHeldPorts), says how many stay held when that changed from was, and returns
// the new count.
func (b *Backend) trimHeldPorts(dp *bpf.Datapath, was int) int {
	n, err := dp.TrimHeldPorts()
	if err != nil {
		b.log.Warn("cannot release the ports of earlier --to-ports ranges", "error", err)
		return was
	}
	switch {
	case n == was:
	case n == 0:
		b.log.Info("the flows of earlier --to-ports ranges have ended: their ports are released")
	default:
		b.log.Info("ports of earlier --to-ports ranges stay held for their flows", "ports", n)
	}
	return n
}
