package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// checkBudget bounds the trie entries CheckPolicy reads in one call: a policy of the usual size
// (tens of rules) is looked at whole every time, a huge one in turns (100k entries in about 7
// minutes at one call a second), at well under a millisecond per call.
const checkBudget = 256

// checkState is where CheckPolicy's walk of the tries stands (guarded by Datapath.mu); a sync
// starts it over.
type checkState struct {
	// config is the nat_config the last sync wrote.
	config masqNatConfig
	// trie is the index in Datapath.tries of the trie being walked, walk the walk (nil: not
	// started), walked how many entries it read, first the first of them, and matched how many
	// held the value of the last sync.
	trie    int
	walk    trieWalk
	walked  int
	first   trieKey
	matched int
}

// PolicyDrift says which of the maps that decide verdicts no longer hold what the last
// SyncPolicy wrote.
type PolicyDrift struct {
	// Tries names the tries (masq_v4, nomasq_v4, masq_v6, nomasq_v6, src_v4, src_v6) found
	// changed. The source rules' own tries (rmasq_v4, ...) and src_cfg are not checked.
	Tries []string
	// NATConfig tells that nat_config changed.
	NATConfig bool
}

// CheckPolicy tells, cheaply enough to ask every second, whether the maps that decide verdicts
// still hold what the last SyncPolicy wrote. Nothing before the first sync.
//
//   - The tries are walked in turns, up to checkBudget entries a call (one batch lookup) and
//     once around at most: an entry added behind the agent's back, or whose value changed, is
//     caught when the walk reaches it; one deleted, at the end of the walk of its trie, which
//     finds fewer entries than the sync wrote. Either is caught within
//     len(entries)/checkBudget + 1 calls (twice that when entries of one trie are deleted
//     while its walk is under way).
//   - nat_config is compared whole.
//
// The port table (nat_ports) is not checked.
func (d *Datapath) CheckPolicy() (PolicyDrift, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var drift PolicyDrift
	if d.synced == nil {
		return drift, nil
	}
	changed, err := d.walkTries(checkBudget)
	if err != nil {
		return drift, err
	}
	for _, t := range d.checked() {
		if changed[t] {
			drift.Tries = append(drift.Tries, t.name)
		}
	}
	var cfg masqNatConfig
	if err := d.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		return drift, fmt.Errorf("check nat_config: %w", err)
	}
	drift.NATConfig = cfg != d.check.config
	return drift, nil
}

// walkTries moves the walk of CheckPolicy on by up to budget entries, or once around the tries,
// and returns the tries it found changed.
func (d *Datapath) walkTries(budget int) (map[*trie]bool, error) {
	c := &d.check
	changed := map[*trie]bool{}
	tries := d.checked()
	for ends := 0; budget > 0 && ends < len(tries); {
		t := tries[c.trie]
		if c.walk == nil {
			c.walk, c.walked, c.matched = t.ops.walk(t.m), 0, 0
		}
		entries, done, err := c.walk.next(budget)
		if err != nil {
			return nil, fmt.Errorf("check %s: %w", t.name, err)
		}
		// A walk meets its first entry again only when the entry it stopped at is gone.
		restarted := c.walked > 0 && len(entries) > 0 && entries[0].prefix == c.first
		if !restarted {
			for _, e := range entries {
				if c.walked == 0 {
					c.first = e.prefix
				}
				c.walked++
				if want, ok := t.held[e.prefix]; ok && e.trieValue == want {
					c.matched++
				} else {
					changed[t] = true // added, or its slot, action or address changed
				}
			}
			budget -= len(entries)
		}
		if done || restarted {
			if restarted || c.matched != len(t.held) {
				changed[t] = true // deleted
			}
			c.trie, c.walk = (c.trie+1)%len(tries), nil
			ends++
		}
	}
	return changed, nil
}

// checked are the tries CheckPolicy walks: the global ones and the source tries.
func (d *Datapath) checked() []*trie { return append(slices.Clip(d.tries), d.srcTries...) }

// MissingPins returns the names of the maps whose pin under LoadOptions.PinPath is gone (nil
// when the datapath was loaded without pinning). Without its pin a map lives on while the
// programs use it, but the next agent would create an empty one.
func (d *Datapath) MissingPins() ([]string, error) {
	if d.opts.PinPath == "" {
		return nil, nil
	}
	var out []string
	for _, name := range MapNames() {
		if _, err := os.Lstat(filepath.Join(d.opts.PinPath, name)); errors.Is(err, fs.ErrNotExist) {
			out = append(out, name)
		} else if err != nil {
			return nil, fmt.Errorf("check pin of %s: %w", name, err)
		}
	}
	return out, nil
}

// Repin pins again the maps whose pins are gone, and returns their names.
func (d *Datapath) Repin() ([]string, error) {
	missing, err := d.MissingPins()
	if err != nil || len(missing) == 0 {
		return nil, err
	}
	if err := os.MkdirAll(d.opts.PinPath, 0o700); err != nil {
		return nil, fmt.Errorf("create pin directory: %w", err)
	}
	maps := d.Maps()
	for _, name := range missing {
		m := maps[name]
		// Unpin forgets the path the map believes it is pinned at (a no-op on the file, which is
		// gone), so that Pin creates it again.
		if err := m.Unpin(); err != nil {
			return nil, fmt.Errorf("pin %s again: %w", name, err)
		}
		if err := m.Pin(filepath.Join(d.opts.PinPath, name)); err != nil {
			return nil, fmt.Errorf("pin %s again: %w", name, err)
		}
	}
	return missing, nil
}
