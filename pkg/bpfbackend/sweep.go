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
// Tables of the default size or smaller are walked every interval, as they always were. In
// larger ones a walk need not come every interval: it says when the first flow it left can
// expire, and a flow made or changed after it can expire no sooner than the shortest timeout
// after it (bpf.SweepResult.Due), and the next walk comes at the first tick after that (with the
// default timeouts, ICMP's 30 s the shortest, every 30 to 40 s); and no sooner than sweepDuty
// times its own duration after the last began, so that the walks take at most 1/sweepDuty of a
// CPU: a table of 2M entries that takes 1.1 s is walked every 2 minutes or so, and a flow may
// outlive its timeout by that much, as conntrack's own garbage collection leaves expired
// connections until its next scan. A table under pressure, or held fragments, make the walks
// come every interval again (bpf.SweepResult.Urgent), and so do timeouts that changed; a table
// that fills between walks is noticed at the next.
//
// The walk counts what it leaves, by protocol, table and state (its census): in large tables the
// NAT metrics report that, so that a scrape reads none of the table (the counts are then as old
// as the last walk); smaller ones a scrape counts itself.

// sweepDuty is how many times its own duration the sweep waits, at least, after a walk began.
const sweepDuty = 100

// census is what the last walk counted, and how many entries it read.
type census struct {
	counts map[policy.Family][]bpf.NATCount
	read   int
}

// largeTables is how many entries a walk reads, at least, in tables larger than the default:
// only there are the walks spaced out and do the metrics report the census.
const largeTables = bpf.DefaultNATEntries + 1

// sweepLoop expires idle NAT entries until ctx ends.
func (b *Backend) sweepLoop(ctx context.Context) {
	t := time.NewTicker(b.opts.SweepInterval)
	defer t.Stop()
	held := 0 // ports of earlier --to-ports ranges held, as last logged
	var (
		timeouts bpf.Timeouts  // as last logged
		walked   *bpf.Datapath // the datapath the last walk was of
		with     bpf.Timeouts  // the timeouts it judged by
		due      time.Time     // when the next walk is due
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-b.sweepNow:
		}
		dp := b.dp.Load()
		if dp == nil {
			continue
		}
		// Shorter timeouts (a sysctl changed) may have expired flows the last walk left.
		if now := b.timeouts(&timeouts); dp != walked || now != with || !time.Now().Before(due) {
			next, err := b.walk(dp, now)
			if err != nil {
				b.log.Warn("NAT sweep failed", "error", err)
				continue
			}
			walked, with, due = dp, now, next
			// Trimming reads every entry too (when ports are held at all): as often as the walks.
			held = b.trimHeldPorts(dp, held)
		}
		b.checkDraining(ctx, dp)
	}
}

// walk sweeps dp's tables, publishes their census, and returns when the next walk is due.
func (b *Backend) walk(dp *bpf.Datapath, t bpf.Timeouts) (time.Time, error) {
	start, mono := time.Now(), bpf.MonotonicNow()
	res, err := dp.Sweep(mono, t)
	if err != nil {
		return start, err
	}
	b.census.Store(&census{counts: res.Counts, read: res.Read})
	next := nextWalk(start, mono, res, time.Since(start), cmp.Or(b.largeTables, largeTables))
	msg := "NAT walk" // removed no flow
	if res.Flows > 0 || res.Orphans > 0 || res.Fragments > 0 {
		msg = "NAT sweep"
	}
	b.log.Debug(msg, "flows", res.Flows, "orphanEntries", res.Orphans, "keptVerdicts", res.Kept,
		"heldFragments", res.Fragments, "entriesRead", res.Read, "took", time.Since(start),
		"nextWalkIn", time.Until(next).Round(time.Millisecond))
	return next, nil
}

// nextWalk is when the walk that began at start (mono on MonotonicNow's clock), took long and
// found res, wants the next: in large tables (large: read at least that many entries) when res
// is due and no sooner than sweepDuty times took after start; at once in small tables, and when
// res is urgent.
func nextWalk(start time.Time, mono time.Duration, res bpf.SweepResult, took time.Duration, large int) time.Time {
	if res.Urgent || res.Read < large {
		return start
	}
	return start.Add(max(res.Due-mono, sweepDuty*took))
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
