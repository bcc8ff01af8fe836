// Package bpf loads the SNAT engine (bpf/masq.c: a tc egress and a tc ingress program) and keeps
// its maps in step with the policy: the rule tries, the outbound action and NAT settings, the
// per-uplink SNAT addresses and the rule counters. It also reads and expires the NAT table.
//
// Attaching the programs to devices is the caller's business (tcx or clsact); so is deciding
// when to sweep. Every method is safe for concurrent use.
package bpf

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

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
	// claim resets the slots a sync claims in the kernel; nil where claim_slots cannot load
	// (claimErr says why), and then resetSlots writes the maps itself.
	claim    *claimer
	claimErr error

	mu sync.Mutex // serialises the writers below
	// slots assigns counter slots to rules; tries are the four tries, each with the mirror of
	// its content that lets a sync write only the difference.
	slots *slotTable
	tries []*trie
	// srcTries are the source tries (IPv4 first), ruleTries the rule tries of each source rule
	// id that a sync writes or whose entries the maps hold, srcNames the name of each id the
	// last sync wrote (sources.go).
	srcTries  []*trie
	ruleTries map[uint32][]*trie
	srcNames  map[uint32]string
	// ports are the ranges nat_ports holds; held the ports held_ports holds (heldports.go), and
	// heldGen counts the syncs that held more of them.
	ports   policy.PortRanges
	held    portBits
	heldGen uint64
	// synced is the last policy written, syncedPlan its plan and syncedSlots the slot of each
	// of the plan's keys; syncedGen is the slot table's generation that sync left (heldSlots).
	synced      *policy.Policy
	syncedPlan  *plan
	syncedSlots []uint32
	syncedGen   uint64
	// planned is the policy plan was made for (see planFor); policies are not modified after
	// they are compiled, so the pointer identifies the plan.
	planned *policy.Policy
	plan    *plan
	// check is what CheckPolicy compares the maps with.
	check checkState
	// portSeed is nat_config's port_seed: chosen once, kept by every sync and restart.
	portSeed uint32

	// fill is what the sweep knows of how full each family's confirmed table is, IPv4 first.
	fill [2]tableFill
}

// SlotClaimsInMaps says why the counters of new rules are zeroed by batch map updates rather
// than by claim_slots in the kernel (a kernel before 5.19), or nil.
func (d *Datapath) SlotClaimsInMaps() error { return d.claimErr }

// Close releases the programs and maps (pinned maps stay in the bpffs).
func (d *Datapath) Close() error {
	if d.claim != nil {
		if err := d.claim.close(); err != nil {
			return fmt.Errorf("close claim_slots: %w", err)
		}
	}
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

// scratchMaps are the programs' per-CPU working space (bpf/parse.h: cpu_packet, bpf/flow.h:
// cpu_scratch) and the empty held fragment new ones are made from (bpf/maps.h: frag_blank):
// nothing in them outlives a run of a program, so each load has its own, unpinned,
// and no layout has them (their types may change in any build). Every other function of this
// package passes them over (Maps, MapNames, the pins, the layouts). nat_scratch is the scratch
// that the builds of layout 5 before this one pinned: Load removes its pin.
var scratchMaps = map[string]bool{masqMapCpuPacket: true, masqMapCpuScratch: true, masqMapFragBlank: true, "nat_scratch": true}

// ownMap tells whether the map of the object named name is one a load makes for itself, unpinned:
// a scratch map, or a data section (.rodata, the constants a load sets: bpf/parse.h), whose name
// a bpffs would not even take.
func ownMap(name string) bool { return scratchMaps[name] || strings.HasPrefix(name, ".") }
