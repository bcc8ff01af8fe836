package bpf

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Source rules in the maps (bpf/types.h has the C side). Each source rule has an id, which it
// keeps while its name stays (so that its counters and trie entries stay too): src_cfg[id] holds
// its name and family settings, the rule tries (rmasq_v4, rnomasq_v4, rmasq_v6, rnomasq_v6)
// hold its lists under the id, and the source tries (src_v4, src_v6) map each source prefix to
// the id of the first rule that holds it. A program looks the source up once per new flow, then
// the rule's lists: the cost of a packet does not grow with the rules or their sources.
//
// A sync writes, in order: every set's trie entries (the global lists' and each rule's), each
// rule's src_cfg entry and nat_config, then the source tries, then deletes the stale source
// entries, then the stale trie entries, then the src_cfg entries of the rules gone. A source
// thus names a rule only while all of that rule's lists and settings are written, and every
// address decides, at each step, by the old or the new rule of its source, with that rule's
// lists as SyncPolicy says of the global ones (at worst, briefly, a mix of its old and new).

// ruleTrieMaps are the rule tries; sourceMaps the maps that name source rules by id. Where the
// rule tries are made anew (Grow, a resize on Open), so are the others, so that programs still
// attached to the old rule tries never meet an id that only the new ones hold.
var (
	ruleTrieMaps = []string{masqMapRmasqV4, masqMapRnomasqV4, masqMapRmasqV6, masqMapRnomasqV6}
	sourceMaps   = []string{masqMapSrcV4, masqMapSrcV6, masqMapSrcCfg}
)

// maxSourceEntries bounds the entries of each source trie: every rule's CIDRs and this node's
// pods that selector rules choose. The tries allocate per entry, so the room costs nothing unused.
const maxSourceEntries = 65536

// maxSourceID is the largest id a source rule can have (C: MAX_SOURCE_IDS - 1): twice
// config.MaxSourceRules and more, so that a sync that replaces every rule finds fresh ids.
const maxSourceID = 2047

// sourceNameLen is the room for a rule's name in src_cfg (C: SOURCE_NAME_LEN).
const sourceNameLen = len(masqSrcRule{}.Name)

// sourceIDs returns the id of each source rule of p: the one its name held in the last sync (or
// in the pinned maps), else the lowest id that no rule of the last sync holds and no rule trie
// holds entries of, so that a new rule never meets a removed rule's entries or counters. Ids
// beyond maxSourceID are 0, which the plan refuses.
func (d *Datapath) sourceIDs(p *policy.Policy) []uint32 {
	ids := make([]uint32, len(p.Sources))
	taken := map[uint32]bool{}
	for id := range d.srcNames {
		taken[id] = true
	}
	for id := range d.ruleTries {
		taken[id] = true
	}
	byName := make(map[string]uint32, len(d.srcNames))
	for id, name := range d.srcNames {
		byName[name] = id
	}
	next := uint32(1)
	for i, s := range p.Sources {
		if id, ok := byName[s.Name]; ok {
			ids[i] = id
			continue
		}
		for next <= maxSourceID && taken[next] {
			next++
		}
		if next <= maxSourceID {
			ids[i] = next
			taken[next] = true
		}
	}
	return ids
}

// planSources plans the source tries: each family's source table, its rules as their ids.
func (pl *plan) planSources(p *policy.Policy, ids []uint32) error {
	pl.sources = map[policy.Family][]trieEntry{}
	for i, s := range p.Sources {
		if ids[i] == 0 {
			return fmt.Errorf("source rule %s: all %d source rule ids are in use", s.Name, maxSourceID)
		}
		if len(s.Name) > sourceNameLen {
			return fmt.Errorf("source rule %s: a name longer than %d bytes", s.Name, sourceNameLen)
		}
	}
	for _, fam := range policy.Families() {
		if !p.Enabled(fam) {
			continue
		}
		table := p.SourceTable(fam)
		if len(table) > maxSourceEntries {
			return fmt.Errorf("%s: %d source prefixes, the datapath takes at most %d", fam, len(table), maxSourceEntries)
		}
		entries := make([]trieEntry, len(table))
		for j, e := range table {
			entries[j] = trieEntry{e.Prefix, trieValue{rule: ids[e.Rule]}}
		}
		slices.SortFunc(entries, func(a, b trieEntry) int { return prefixOrder(a.prefix, b.prefix) })
		pl.sources[fam] = entries
	}
	return nil
}

// newSourceTries lists the source tries of the loaded maps, IPv4 first, with empty mirrors.
func (d *Datapath) newSourceTries() []*trie {
	o := &d.objs
	return []*trie{
		{trieKind{policy.IPv4, policy.Return, 0}, masqMapSrcV4, o.SrcV4, lpmOps[masqLpm4Key, masqSrcVal]{}, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv6, policy.Return, 0}, masqMapSrcV6, o.SrcV6, lpmOps[masqLpm6Key, masqSrcVal]{}, map[trieKey]trieValue{}, nil},
	}
}

// newRuleTries lists the rule tries of source rule id, in the order of newTries, with empty
// mirrors: four views of the shared maps, each of the entries under its id.
func (d *Datapath) newRuleTries(id uint32) []*trie {
	o := &d.objs
	v4, v6 := ruleOps[masqRlpm4Key, masqLpm4Val]{id}, ruleOps[masqRlpm6Key, masqLpm6Val]{id}
	return []*trie{
		{trieKind{policy.IPv4, policy.Masquerade, id}, masqMapRmasqV4, o.RmasqV4, v4, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv4, policy.Return, id}, masqMapRnomasqV4, o.RnomasqV4, v4, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv6, policy.Masquerade, id}, masqMapRmasqV6, o.RmasqV6, v6, map[trieKey]trieValue{}, nil},
		{trieKind{policy.IPv6, policy.Return, id}, masqMapRnomasqV6, o.RnomasqV6, v6, map[trieKey]trieValue{}, nil},
	}
}

// policyTries are the tries a sync of pl writes: the global ones, then the rule tries of each
// source rule of pl, then those of rules gone that still hold entries (their want is empty).
func (d *Datapath) policyTries(pl *plan) []*trie {
	tries := slices.Clone(d.tries)
	for _, ps := range pl.sets[1:] {
		if d.ruleTries[ps.set] == nil {
			d.ruleTries[ps.set] = d.newRuleTries(ps.set)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(d.ruleTries)) {
		tries = append(tries, d.ruleTries[id]...)
	}
	return tries
}

// writeSourceRules writes src_cfg's entry of every source rule of pl: its name and the settings
// of its families with their outbound slots.
func (d *Datapath) writeSourceRules(pl *plan, slots []uint32) error {
	var ids []uint32
	var vals []masqSrcRule
	for _, ps := range pl.sets[1:] {
		cfg := ps.withSlots(slots)
		v := masqSrcRule{V4: cfg.V4, V6: cfg.V6}
		for i := range min(len(ps.name), sourceNameLen) {
			v.Name[i] = int8(ps.name[i])
		}
		ids, vals = append(ids, ps.set), append(vals, v)
	}
	if err := putAll(d.objs.SrcCfg, ids, vals); err != nil {
		return fmt.Errorf("write %s: %w", masqMapSrcCfg, err)
	}
	return nil
}

// syncSources writes the source tries: the new entries, then the stale ones deleted, so that a
// source moves from its old rule to its new one (or to the global lists) without a gap.
func (d *Datapath) syncSources(pl *plan) error {
	want := make([][]trieEntry, len(d.srcTries))
	for i, t := range d.srcTries {
		want[i] = pl.sources[t.family]
	}
	diffs, err := d.putTries(d.srcTries, want, make([]bool, len(d.srcTries)))
	if err != nil {
		return err
	}
	return d.deleteStale(d.srcTries, diffs)
}

// dropSourceRules clears the src_cfg entries of the rules that pl lacks (no source names them
// now, and their trie entries are gone) and forgets their tries; the rules of pl are the ones
// synced.
func (d *Datapath) dropSourceRules(pl *plan) error {
	names := map[uint32]string{}
	for _, ps := range pl.sets[1:] {
		names[ps.set] = ps.name
	}
	var gone []uint32
	for id := range d.srcNames {
		if _, ok := names[id]; !ok {
			gone = append(gone, id)
		}
	}
	for id, tries := range d.ruleTries {
		if _, ok := names[id]; ok {
			continue
		}
		if _, ok := d.srcNames[id]; !ok {
			gone = append(gone, id) // of a sync that failed midway
		}
		empty := true
		for _, t := range tries {
			empty = empty && len(t.held) == 0
		}
		if empty {
			delete(d.ruleTries, id)
		}
	}
	if err := putAll(d.objs.SrcCfg, gone, make([]masqSrcRule, len(gone))); err != nil {
		return fmt.Errorf("clear %s: %w", masqMapSrcCfg, err)
	}
	d.srcNames = names
	return nil
}

// recoverSources reads back the source rules' ids (src_cfg), the source tries and the rule
// tries (each shared map read once, its entries sorted out by id).
func (d *Datapath) recoverSources() error {
	d.srcNames = map[uint32]string{}
	if err := eachEntry(d.objs.SrcCfg, func(id uint32, v *masqSrcRule) {
		if name := sourceName(v); name != "" {
			d.srcNames[id] = name
		}
	}); err != nil {
		return fmt.Errorf("read %s: %w", masqMapSrcCfg, err)
	}
	d.srcTries = d.newSourceTries()
	for _, t := range d.srcTries {
		if err := t.read(); err != nil {
			return err
		}
	}
	d.ruleTries = map[uint32][]*trie{}
	for id := range d.srcNames {
		d.ruleTries[id] = d.newRuleTries(id)
	}
	for i, m := range []*ebpf.Map{d.objs.RmasqV4, d.objs.RnomasqV4, d.objs.RmasqV6, d.objs.RnomasqV6} {
		into := func(id uint32, p trieKey, v trieValue) {
			if d.ruleTries[id] == nil {
				d.ruleTries[id] = d.newRuleTries(id)
			}
			if t := d.ruleTries[id][i]; v.action == t.action {
				t.held[p] = v
			}
		}
		var err error
		if i < 2 {
			err = readRuleTrie[masqRlpm4Key, masqLpm4Val](m, into)
		} else {
			err = readRuleTrie[masqRlpm6Key, masqLpm6Val](m, into)
		}
		if err != nil {
			return fmt.Errorf("read %s: %w", m.String(), err)
		}
	}
	return nil
}

// sourceName is the name a src_cfg entry holds ("": none).
func sourceName(v *masqSrcRule) string {
	b := make([]byte, 0, len(v.Name))
	for _, c := range v.Name {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// sourceSettings is the family settings src_cfg holds for source rule id, as nat_config holds
// the global ones.
func (d *Datapath) sourceSettings(id uint32) (masqNatConfig, error) {
	var v masqSrcRule
	if err := d.objs.SrcCfg.Lookup(id, &v); err != nil {
		return masqNatConfig{}, fmt.Errorf("read %s: %w", masqMapSrcCfg, err)
	}
	return masqNatConfig{V4: v.V4, V6: v.V6}, nil
}

// sourceRuleName is the name of the source rule of id in the maps ("" for the global lists).
func (d *Datapath) sourceRuleName(id uint32) string { return d.srcNames[id] }

// ruleLPMKey is a rule trie's key as the map holds it: a source rule's id and a prefix.
type ruleLPMKey[K any] interface {
	rawLPMKey[K]
	ruleID() uint32
	withRule(id uint32, p trieKey) K
}

// The id's 32 bits come first in the key: a prefix of b bits is 32 + b bits of it.
func (k masqRlpm4Key) prefix() trieKey {
	return netip.PrefixFrom(netip.AddrFrom4(k.Addr), int(k.Prefixlen)-32)
}

func (k masqRlpm6Key) prefix() trieKey {
	return netip.PrefixFrom(netip.AddrFrom16(k.Addr), int(k.Prefixlen)-32)
}

func (k masqRlpm4Key) ruleID() uint32 { return k.Rule }
func (k masqRlpm6Key) ruleID() uint32 { return k.Rule }

func (k masqRlpm4Key) withPrefix(p trieKey) masqRlpm4Key { return k.withRule(k.Rule, p) }
func (k masqRlpm6Key) withPrefix(p trieKey) masqRlpm6Key { return k.withRule(k.Rule, p) }

func (masqRlpm4Key) withRule(id uint32, p trieKey) masqRlpm4Key {
	return masqRlpm4Key{Prefixlen: 32 + uint32(p.Bits()), Rule: id, Addr: p.Addr().As4()}
}

func (masqRlpm6Key) withRule(id uint32, p trieKey) masqRlpm6Key {
	return masqRlpm6Key{Prefixlen: 32 + uint32(p.Bits()), Rule: id, Addr: p.Addr().As16()}
}

// The source tries' values hold a rule id alone.
func (v masqSrcVal) value() trieValue { return trieValue{rule: v.Rule} }

func (masqSrcVal) withValue(v trieValue) masqSrcVal { return masqSrcVal{Rule: v.rule} }

// readRuleTrie reads every entry of a rule trie, with its rule's id.
func readRuleTrie[K ruleLPMKey[K], V rawLPMVal[V]](m *ebpf.Map, fn func(id uint32, p trieKey, v trieValue)) error {
	return eachEntry(m, func(k K, v *V) { fn(k.ruleID(), k.prefix(), (*v).value()) })
}

// ruleOps implements trieOps for the entries of one source rule (id) in a rule trie of key
// layout K and value layout V. Reading or walking them reads the whole shared map: the sync
// reads the rule tries once (recoverSources), and CheckPolicy walks the global and source tries.
type ruleOps[K ruleLPMKey[K], V rawLPMVal[V]] struct{ id uint32 }

func (o ruleOps[K, V]) keys(prefixes []trieKey) []K {
	var zero K
	keys := make([]K, len(prefixes))
	for i, p := range prefixes {
		keys[i] = zero.withRule(o.id, p)
	}
	return keys
}

func (o ruleOps[K, V]) read(m *ebpf.Map, fn func(trieKey, trieValue)) error {
	return readRuleTrie[K, V](m, func(id uint32, p trieKey, v trieValue) {
		if id == o.id {
			fn(p, v)
		}
	})
}

func (o ruleOps[K, V]) put(m *ebpf.Map, entries []trieEntry) error {
	var (
		zk K
		zv V
	)
	keys, vals := make([]K, len(entries)), make([]V, len(entries))
	for i, e := range entries {
		keys[i], vals[i] = zk.withRule(o.id, e.prefix), zv.withValue(e.trieValue)
	}
	return putAll(m, keys, vals)
}

func (o ruleOps[K, V]) delete(m *ebpf.Map, prefixes []trieKey) error {
	_, err := deleteAll(m, o.keys(prefixes))
	return err
}

func (o ruleOps[K, V]) walk(m *ebpf.Map) trieWalk {
	return &ruleWalk[K, V]{lpmWalk: lpmWalk[K, V]{mapReader: mapReader{m: m}}, id: o.id}
}

// ruleWalk is an lpmWalk over the entries of one rule id.
type ruleWalk[K ruleLPMKey[K], V rawLPMVal[V]] struct {
	lpmWalk[K, V]
	id uint32
}

func (w *ruleWalk[K, V]) next(max int) ([]trieEntry, bool, error) {
	if len(w.keys) < max {
		w.keys, w.vals = make([]K, max), make([]V, max)
	}
	n, over, err := readInto(&w.mapReader, w.keys[:max], w.vals[:max])
	if err != nil {
		return nil, false, err
	}
	var entries []trieEntry
	for i := range n {
		if w.keys[i].ruleID() == w.id {
			entries = append(entries, trieEntry{w.keys[i].prefix(), w.vals[i].value()})
		}
	}
	return entries, over || n == 0, nil
}
