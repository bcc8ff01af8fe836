package bpfbackend

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The pinned maps, as the backend keeps them: opened by the first Apply over what is pinned
// (bpf.Open: this layout's maps, at the sizes asked, what older layouts held migrating into
// them), grown when a policy outgrows the rule maps, synced with each policy, and the migration
// finished once the programs are swapped.

// syncMaps writes p into the maps of the datapath (b.dp), which the first Apply opens and a
// policy that outgrows the rule maps grows: the pins that are gone pinned again, and p written.
// inForce tells that p is the policy in force (a resync, a retry, a drift repair): the tries are
// then re-read first, so that entries changed behind the agent's back are written again. A new
// policy (a config change) skips the re-read, which costs a syscall per entry: drift in between
// is the drift check's to find, and its repair re-applies this policy.
func (b *Backend) syncMaps(p *policy.Policy, inForce bool) error {
	dp, err := b.datapathFor(p)
	if err != nil {
		return err
	}
	if repinned, err := dp.Repin(); err != nil {
		return err
	} else if len(repinned) > 0 {
		b.log.Warn("map pins were missing; pinned again", "maps", repinned)
	}
	if inForce {
		if err := dp.Refresh(); err != nil {
			return fmt.Errorf("read the maps: %w", err)
		}
	}
	return dp.SyncPolicy(p)
}

// datapathFor returns the datapath, opened by the first Apply, with rule maps that can hold p.
func (b *Backend) datapathFor(p *policy.Policy) (*bpf.Datapath, error) {
	dp := b.dp.Load()
	if dp == nil {
		opened, err := b.open(p)
		if err != nil {
			return nil, err
		}
		dp = opened.Datapath
		b.migration = opened.Migration
		b.dp.Store(dp)
		b.sweepSoon() // the metrics count its tables from the first walk on
	}
	need, err := dp.SlotsNeeded(p)
	if err != nil {
		return nil, err
	}
	bigger, err := dp.Grow(need)
	if err != nil || bigger == dp {
		return bigger, err
	}
	b.log.Info("the policy needs more rule slots than the maps have; loaded larger rule maps, keeping the counters",
		"from", dp.RuleCapacity(), "to", bigger.RuleCapacity())
	b.dp.Store(bigger)
	if err := dp.Close(); err != nil {
		b.log.Warn("closing the smaller rule maps", "error", err)
	}
	return bigger, nil
}

// open opens the datapath over what is pinned (bpf.Open) for p, and reports what it found: a
// refusal of pins this agent must leave alone (Info says so until an open succeeds), maps
// replaced for their size, a migration begun.
func (b *Backend) open(p *policy.Policy) (*bpf.Opened, error) {
	opened, err := bpf.Open(b.pinRoot, bpf.OpenOptions{NATEntries: b.opts.NATEntries, Policy: p, ReplaceNewer: b.opts.ReplaceNewer})
	refused := ""
	if errors.Is(err, bpf.ErrUnknownLayout) {
		refused = err.Error()
		err = fmt.Errorf("%w: %w; nothing was changed (roll the agent forward, or replace them: --replace-newer-layout)", datapath.ErrRefused, err)
	}
	b.mu.Lock()
	if refused != "" && b.refused == "" {
		b.log.Error("refusing the pinned maps: they are of a layout this agent does not know", "error", refused)
	}
	b.refused = refused
	b.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if len(opened.Resized) > 0 {
		var why, dropped []string
		for _, m := range opened.Resized {
			why = append(why, m.Map+": "+m.Reason)
			if !slices.Contains(opened.Carried, m.Map) {
				dropped = append(dropped, m.Map)
			}
		}
		b.log.Warn("pinned maps have other sizes; replacing them, the flow state's carried into the new ones",
			"maps", why, "carried", opened.Carried, "startOver", dropped)
	}
	if len(opened.Replaced) > 0 {
		b.log.Warn("replacing the pinned maps of a newer layout (--replace-newer-layout): this agent's programs take their place, and the flows they held are lost",
			"pins", fmt.Sprint(opened.Replaced))
	}
	if mig := opened.Migration; mig != nil {
		b.logMigration(mig, opened.Migrated)
	}
	rules, err := opened.InstalledRules()
	if err != nil {
		opened.Close()
		return nil, err
	}
	b.log.Info("datapath loaded", "pins", b.pinDir, "layout", bpf.Layout, "reusedRules", len(rules), "took", opened.Loaded)
	if err := opened.SlotClaimsInMaps(); err != nil && bpf.ClaimsUnsupported() == nil {
		// The kernel has what claim_slots needs (else Missing says so at the start), so this
		// is a fault of the build: it works on, as on such a kernel.
		b.log.Warn("new rules' counters are zeroed by map updates, slower for large policies: claim_slots did not load", "error", err)
	}
	return opened, nil
}

// logMigration reports the first pass of a migration.
func (b *Backend) logMigration(mig *bpf.Migration, took time.Duration) {
	srcs := slices.DeleteFunc(mig.Sources(), bpf.Source.Newer) // replaced, not migrated
	if len(srcs) == 0 {
		return
	}
	msg := "migrating the pinned maps of an older layout; their programs run until this agent's replace them"
	if !slices.ContainsFunc(srcs, func(s bpf.Source) bool { return !s.Resized() }) {
		msg = "carrying the entries of the resized maps into the new ones; the old ones serve the programs until this agent's replace them"
	}
	if mig.Resumed() {
		msg = "resuming a migration whose agent stopped after the swap: the old maps are frozen, and only the flows this layout's lack are carried"
	}
	b.log.Info(msg, "from", fmt.Sprint(srcs), "to", bpf.Layout, "entries", mig.Entries, "took", took)
	if mig.NoRoom > 0 {
		b.log.Warn("the confirmed NAT tables are smaller than the flows they held: those without room were carried into the unreplied ones, where they work but can be evicted",
			"entries", mig.NoRoom)
	}
}

// finishMigration, after an Apply put this agent's programs on every uplink (and took them off
// every other device), carries what the old programs did meanwhile and removes the old pins.
func (b *Backend) finishMigration(dp *bpf.Datapath) error {
	if b.migration == nil {
		return nil
	}
	start := time.Now()
	before := maps.Clone(b.migration.Entries)
	if err := b.migration.Finish(dp); err != nil {
		return fmt.Errorf("finish the migration: %w", err)
	}
	caught := map[string]int{}
	for name, n := range b.migration.Entries {
		if n -= before[name]; n > 0 {
			caught[name] = n
		}
	}
	b.log.Info("migration finished: the old programs are replaced, their entries since carried, their pins removed",
		"from", fmt.Sprint(b.migration.Sources()), "caughtUp", caught, "took", time.Since(start))
	b.migration = nil
	return nil
}
