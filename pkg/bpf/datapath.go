// Package bpf loads the SNAT engine (bpf/masq.c: a tc egress and a tc ingress program) and keeps
// its maps in step with the policy: the rule tries, the outbound action and NAT settings, the
// per-uplink SNAT addresses and the rule counters. It also reads and expires the NAT table.
//
// Attaching the programs to devices is the caller's business (tcx or clsact); so is deciding
// when to sweep. Every method is safe for concurrent use.
package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Defaults of LoadOptions.
const (
	DefaultNATEntries  = 1 << 18
	DefaultFragEntries = 8192
)

// Next to a confirmed table of n entries, the table of unreplied flows has n/2 and the table of
// kept verdicts (one entry per flow) n/4, never fewer than minSideEntries: a flood of unanswered
// flows churns through the room of the unreplied, while the confirmed keep theirs.
const minSideEntries = 1024

func unrepliedEntries(n uint32) uint32 { return max(n/2, minSideEntries) }
func keepEntries(n uint32) uint32      { return max(n/4, minSideEntries) }

// inboundEntries sizes the table of connections from outside that wait for a reply to show the
// node translated their destination (bpf/maps.h: inbound_v4): n/16, at least minSideEntries.
func inboundEntries(n uint32) uint32 { return max(n/16, minSideEntries) }

// heldEntries sizes each family's room for later fragments that wait for their first one (bpf/
// frag.h), from the fragment table's size: 256 at the default. It is allocated as fragments are
// held, up to FRAG_HELD_BYTES each.
func heldEntries(frag uint32) uint32 { return max(frag/32, 8) }

// LoadOptions size the maps; they are fixed once the maps exist.
type LoadOptions struct {
	// MaxRules is the number of rule counter slots, shared by both families; it bounds the rules
	// of a policy (SyncPolicy fails beyond it) and the capacity of each trie.
	MaxRules uint32
	// NATEntries is the size of each family's table of confirmed flows, which nothing evicts
	// (a flow takes two entries, one per direction); the table of unreplied flows gets half as
	// many, the table of kept verdicts a quarter. NATMemory says what they cost.
	NATEntries uint32
	// NATEntriesV6, when set, sizes the IPv6 tables instead of NATEntries: the tables are
	// preallocated, so a node without IPv6 masquerading can keep them small.
	NATEntriesV6 uint32
	// FragEntries bounds, per family, the datagrams whose later fragments can be translated at
	// once.
	FragEntries uint32
	// PinPath, when set, pins every map by name in that directory (on a bpffs) and reuses maps
	// already pinned there, so an agent restart keeps flows, rules and counters. Reusing fails
	// with an error wrapping ebpf.ErrMapIncompatible when the pinned maps have other sizes. A
	// directory that does not exist is made whole, with every map and the layout record, in a
	// staging directory renamed into place (see LayoutDir for the one the agent uses).
	PinPath string
}

func (o LoadOptions) withDefaults() LoadOptions {
	if o.MaxRules == 0 {
		o.MaxRules = DefaultMaxRules()
	}
	if o.NATEntries == 0 {
		o.NATEntries = DefaultNATEntries
	}
	if o.FragEntries == 0 {
		o.FragEntries = DefaultFragEntries
	}
	if o.NATEntriesV6 == 0 {
		o.NATEntriesV6 = o.NATEntries
	}
	return o
}

// spec is the collection spec with the maps sized by o (which has its defaults).
func (o LoadOptions) spec() (*ebpf.CollectionSpec, error) {
	spec, err := loadMasq()
	if err != nil {
		return nil, fmt.Errorf("load bpf spec: %w", err)
	}
	var m masqMapSpecs
	if err := spec.Assign(&m); err != nil {
		return nil, fmt.Errorf("load bpf spec: %w", err)
	}
	for _, rules := range []*ebpf.MapSpec{m.MasqV4, m.NomasqV4, m.MasqV6, m.NomasqV6, m.RuleStats, m.RuleSlots} {
		rules.MaxEntries = o.MaxRules
	}
	m.NatV4.MaxEntries, m.NatV6.MaxEntries = o.NATEntries, o.NATEntriesV6
	m.NatNewV4.MaxEntries, m.NatNewV6.MaxEntries = unrepliedEntries(o.NATEntries), unrepliedEntries(o.NATEntriesV6)
	m.KeepV4.MaxEntries, m.KeepV6.MaxEntries = keepEntries(o.NATEntries), keepEntries(o.NATEntriesV6)
	m.FragV4.MaxEntries, m.FragV6.MaxEntries = o.FragEntries, o.FragEntries
	m.FragHeldV4.MaxEntries, m.FragHeldV6.MaxEntries = heldEntries(o.FragEntries), heldEntries(o.FragEntries)
	m.InboundV4.MaxEntries, m.InboundV6.MaxEntries = inboundEntries(o.NATEntries), inboundEntries(o.NATEntriesV6)
	return spec, nil
}

// MapNames lists the names of every map of the datapath (its pins' file names), sorted.
func MapNames() []string {
	var d Datapath
	return slices.Sorted(maps.Keys(d.mapFields()))
}

// Owns tells whether a loaded program is one of the engine's entry points (tc_egress,
// tc_ingress) using the engine's maps: how attaching and cleaning up recognise our programs,
// whichever process loaded them.
func Owns(info *ebpf.ProgramInfo) bool {
	if info.Name != masqProgTcEgress && info.Name != masqProgTcIngress {
		return false
	}
	ids, ok := info.MapIDs()
	if !ok {
		return false
	}
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue
		}
		mi, err := m.Info()
		m.Close()
		if err == nil && mi.Name == masqMapUplinkSnat {
			return true
		}
	}
	return false
}

// Datapath is the loaded programs and maps.
type Datapath struct {
	objs masqObjects
	opts LoadOptions

	mu sync.Mutex // serialises the writers below
	// slots assigns counter slots to rules; tries are the four tries, each with the mirror of
	// its content that lets a sync write only the difference.
	slots *slotTable
	tries []*trie
	// ports are the ranges nat_ports holds; held the ports held_ports holds (heldports.go), and
	// heldGen counts the syncs that held more of them.
	ports   policy.PortRanges
	held    portBits
	heldGen uint64
	// synced is the last policy written, with each rule's slot.
	synced     *policy.Policy
	syncedSlot map[*policy.Rule]uint32
	// planned is the policy plan was made for (see planFor); policies are not modified after
	// they are compiled, so the pointer identifies the plan.
	planned *policy.Policy
	plan    *plan
	// check is what CheckPolicy compares the maps with.
	check checkState
	// portSeed is nat_config's port_seed: chosen once, kept by every sync and restart.
	portSeed uint32

	// confirmedSeen is how many entries the last sweep found in each family's confirmed table.
	confirmedSeen [2]atomic.Int64
}

// Load creates (or, with PinPath, reuses) the maps and loads both programs.
func Load(opts LoadOptions) (*Datapath, error) {
	opts = opts.withDefaults()
	spec, err := opts.spec()
	if err != nil {
		return nil, err
	}
	var copts ebpf.CollectionOptions
	if opts.PinPath != "" {
		for name, m := range spec.Maps {
			if !scratchMaps[name] {
				m.Pinning = ebpf.PinByName
			}
		}
		copts.Maps.PinPath = opts.PinPath
		if err := makePinDir(opts.PinPath, spec); err != nil {
			return nil, err
		}
		if err := RemovePins(opts.PinPath, slices.Sorted(maps.Keys(scratchMaps))...); err != nil {
			return nil, err
		}
	}
	d := &Datapath{opts: opts}
	if err := spec.LoadAndAssign(&d.objs, &copts); err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load bpf objects: %+v", verr)
		}
		return nil, fmt.Errorf("load bpf objects: %w", err)
	}
	if err := d.objs.Layout.Put(uint32(0), layoutRecord()); err != nil {
		d.objs.Close()
		return nil, fmt.Errorf("write the layout record: %w", err)
	}
	if err := d.recover(); err != nil {
		d.objs.Close()
		return nil, err
	}
	return d, nil
}

// makePinDir makes dir, when it does not exist, with every map of spec pinned in it and the
// layout record written: in a staging directory renamed into place, so that the directory
// appears whole or not at all (a staging directory left by a crash is never used).
func makePinDir(dir string, spec *ebpf.CollectionSpec) error {
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		return err // there already (or unreadable)
	}
	staging := stagingDir(dir)
	if err := os.RemoveAll(staging); err != nil {
		return fmt.Errorf("remove the staging directory of an earlier attempt: %w", err)
	}
	if err := os.MkdirAll(staging, 0o700); err != nil {
		return fmt.Errorf("create pin directory: %w", err)
	}
	for name, ms := range spec.Maps {
		if scratchMaps[name] {
			continue
		}
		m, err := ebpf.NewMapWithOptions(ms, ebpf.MapOptions{PinPath: staging})
		if err == nil && name == masqMapLayout {
			err = m.Put(uint32(0), layoutRecord())
		}
		if m != nil {
			m.Close()
		}
		if err != nil {
			return fmt.Errorf("create map %s: %w", name, err)
		}
	}
	if err := os.Rename(staging, dir); err != nil {
		return fmt.Errorf("move the new maps' pins into place: %w", err)
	}
	return nil
}

// Close releases the programs and maps (pinned maps stay in the bpffs).
func (d *Datapath) Close() error {
	if err := d.objs.Close(); err != nil {
		return fmt.Errorf("close bpf objects: %w", err)
	}
	return nil
}

// Unpin removes the maps' pins (LoadOptions.PinPath), e.g. for a cleanup; the maps live on
// while programs or descriptors hold them.
func (d *Datapath) Unpin() error {
	for name, m := range d.Maps() {
		if err := m.Unpin(); err != nil {
			return fmt.Errorf("unpin %s: %w", name, err)
		}
	}
	return nil
}

// Egress is the program for the uplink's tc egress hook.
func (d *Datapath) Egress() *ebpf.Program { return d.objs.TcEgress }

// Ingress is the program for the uplink's tc ingress hook.
func (d *Datapath) Ingress() *ebpf.Program { return d.objs.TcIngress }

// Maps returns every map by name (as `bpftool map` shows them), e.g. for pinning or dumping.
func (d *Datapath) Maps() map[string]*ebpf.Map {
	out := make(map[string]*ebpf.Map)
	for name, m := range d.mapFields() {
		out[name] = *m
	}
	return out
}

// mapFields names the map fields of the generated objects by their ebpf tags (the maps'
// names): the one list of the datapath's maps, as bpf2go wrote it from bpf/masq.c, but for the
// scratch maps.
func (d *Datapath) mapFields() map[string]**ebpf.Map {
	v := reflect.ValueOf(&d.objs.masqMaps).Elem()
	out := make(map[string]**ebpf.Map, v.NumField())
	for i := range v.NumField() {
		if name := v.Type().Field(i).Tag.Get("ebpf"); !scratchMaps[name] {
			out[name] = v.Field(i).Addr().Interface().(**ebpf.Map)
		}
	}
	return out
}

// scratchMaps are the programs' per-CPU working space (bpf/parse.h: cpu_packet, bpf/nat.h:
// cpu_scratch) and the empty held fragment new ones are made from (bpf/maps.h: frag_blank):
// nothing in them outlives a run of a program, so each load has its own, unpinned,
// and no layout has them (their types may change in any build). Every other function of this
// package passes them over (Maps, MapNames, the pins, the layouts). nat_scratch is the scratch
// that the builds of layout 5 before this one pinned: Load removes its pin.
var scratchMaps = map[string]bool{masqMapCpuPacket: true, masqMapCpuScratch: true, masqMapFragBlank: true, "nat_scratch": true}

// eachEntry calls fn with every entry of a map without per-CPU values: a batch lookup per few
// hundred entries where the kernel can (a rule map of 32768 slots is read in a few syscalls),
// else a syscall per entry.
func eachEntry[K, V any](m *ebpf.Map, fn func(K, *V)) error {
	keys, vals := make([]K, entryBatch), make([]V, entryBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return err
		}
		for i := range n {
			fn(keys[i], &vals[i])
		}
		if done {
			return nil
		}
	}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		fn(k, &v)
	}
	return it.Err()
}

// entryBatch is how many entries eachEntry reads per syscall.
const entryBatch = 1024
