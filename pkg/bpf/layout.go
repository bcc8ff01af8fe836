package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
)

// The layout of the pinned maps, and how an agent finds and takes over what an earlier one
// pinned.
//
// Every layout has a number. Layouts 1 and 2 (the agents before layouts had numbers) pinned
// their maps straight under the pin root, <bpffs>/ip-masq-agent/<map>, with no record of their
// layout: they are told apart by the shape of their maps (legacyShapes). From layout 3 on, the
// maps of layout N live in a directory of their own, <root>/vN/, which holds a layout record
// (the layout map: a magic and N), and is created whole (in a staging directory renamed into
// place), so that a vN directory is never half made. An agent finds under the root:
//
//   - its own layout's directory: it reuses the maps there;
//   - pins of older layouts (legacy ones at the root, older vN directories): it migrates their
//     entries into its own maps (Migrate) before its programs replace the old ones, and removes
//     them once its programs run (Migration.Finish);
//   - a layout it does not know (a newer vN, or pins whose shape no layout has): it refuses to
//     start (ErrUnknownLayout) and touches nothing, since a newer agent may still need them.
//
// A map of this layout whose size changes (--nat-max-entries, --enable-ipv6) cannot be reused
// either: its pin is set aside in a directory of resized maps, <root>/vN-resized-<k>, and Load
// makes it anew at the new size. Inspect reports that directory as a source of layout N, so the
// migration carries its entries into the new map as it carries an older layout's (SetAside).
//
// A new directory per layout is what makes a rollback safe: an agent of layout 2 knows nothing
// of v3/, never touches it, and starts over with maps of its own at the root (its flows are
// lost, the newer agent's are kept); rolled forward again, the newer agent merges what the
// older one pinned into its own maps (entries of the older, live ones win a conflict), so that
// flows idle through the rollback survive it too.
//
// Adding layout N+1 (say issue 13's flow-state fields in the NAT entries, layout 5):
//
//  1. Change bpf/types.h or bpf/maps.h, and `make generate`. TestLayoutFixture now fails: the
//     object's maps are no longer those of testdata/layout<N>.o.
//  2. Set Layout to N+1, and add steps[N]: for each map whose entries' bytes changed, how an
//     entry of layout N becomes one of N+1 (a map a step does not name keeps its bytes). A new
//     carried map goes into carried; a map the policy sync writes needs nothing.
//  3. Copy pkg/bpf/masq_bpfel.o to pkg/bpf/bpftest/testdata/layout<N+1>.o (the fixture of the
//     new layout, which the next change will migrate from), and teach bpftest to write the
//     policy in layout N+1 if the policy maps changed (bpftest's policyLayouts).
//  4. The migration tests (TestMigrate, e2e TestUpgradeFromLayout) run from every older layout
//     by themselves; read their failures.
//
// A new map is no new layout: an agent of the layout that lacks it leaves its pin alone (Inspect
// passes over names it does not know in its own layout's directory) and one that has it creates
// it (Load), so builds of one layout can roll back and forth. A change of an existing map's type,
// key or value is a new layout.

// Layout is the layout of the maps this build creates.
const Layout = 5

// layoutMagic is the layout record's magic (C: LAYOUT_MAGIC).
const layoutMagic = "ip-masq-agent"

// firstDirLayout is the first layout whose maps live in a directory of their own.
const firstDirLayout = 3

// ErrUnknownLayout is the error of Inspect for pins that this agent must leave alone: a layout
// newer than Layout (a newer agent's), or pins whose layout it cannot tell.
var ErrUnknownLayout = errors.New("pinned maps of a layout this agent does not know")

// LayoutDir is the directory under the pin root that holds the maps of this build's layout.
func LayoutDir(root string) string { return filepath.Join(root, "v"+strconv.Itoa(Layout)) }

// stagingDir is where a layout directory is made before it is renamed into place: a name
// Inspect ignores, so that a crash halfway leaves nothing that counts (a bpffs takes no dots).
func stagingDir(dir string) string { return dir + "-new" }

var (
	layoutDirName  = regexp.MustCompile(`^v([1-9][0-9]*)$`)
	resizedDirName = regexp.MustCompile(`^v([1-9][0-9]*)-resized-([1-9][0-9]*)$`)
)

// mapShape is what identifies a map's layout: its type and the sizes of its keys and values
// (not max_entries, a size chosen at load time).
type mapShape struct {
	Type      ebpf.MapType
	KeySize   uint32
	ValueSize uint32
}

func (s mapShape) String() string {
	return fmt.Sprintf("%s with %d-byte keys and %d-byte values", s.Type, s.KeySize, s.ValueSize)
}

func shapeOf(m *ebpf.Map) mapShape { return mapShape{m.Type(), m.KeySize(), m.ValueSize()} }

// legacyShapes are the maps of layouts 1 and 2, which only their shapes tell apart: they differ
// in their NAT entries alone (40 bytes with an ifindex in layout 1, 32 in layout 2).
var legacyShapes = func() map[int]map[string]mapShape {
	l2 := map[string]mapShape{
		"event_stats": {ebpf.PerCPUArray, 4, 8},
		"frag_v4":     {ebpf.LRUHash, 12, 4},
		"frag_v6":     {ebpf.LRUHash, 40, 4},
		"masq_v4":     {ebpf.LPMTrie, 8, 4},
		"masq_v6":     {ebpf.LPMTrie, 20, 4},
		"nat_config":  {ebpf.Array, 4, 88},
		"nat_ports":   {ebpf.Array, 4, 2},
		"nat_v4":      {ebpf.LRUHash, 16, 32},
		"nat_v6":      {ebpf.LRUHash, 40, 32},
		"nomasq_v4":   {ebpf.LPMTrie, 8, 4},
		"nomasq_v6":   {ebpf.LPMTrie, 20, 4},
		"rule_slots":  {ebpf.Array, 4, 24},
		"rule_stats":  {ebpf.PerCPUArray, 4, 16},
		"sweep_stats": {ebpf.Array, 4, 8},
		"uplink_snat": {ebpf.Hash, 4, 24},
	}
	l1 := maps.Clone(l2)
	l1["nat_v4"] = mapShape{ebpf.LRUHash, 16, 40}
	l1["nat_v6"] = mapShape{ebpf.LRUHash, 40, 40}
	maps.Copy(l2, laterLegacyMaps)
	return map[int]map[string]mapShape{1: l1, 2: l2}
}()

// laterLegacyMaps are the maps that agents of layout 2 built after its fixture also pinned at
// the root: hook_seen (when the programs last ran on each hook) from commit 4740c28 on, and
// uplink_macs (each uplink's MAC address) from d46cfc9 on. A migration removes them with the
// rest, and carries nothing of them: the programs and each apply write them anew.
var laterLegacyMaps = map[string]mapShape{
	masqMapHookSeen:   {ebpf.Array, 4, 8},
	masqMapUplinkMacs: {ebpf.Hash, 4, 8},
}

// step turns an entry of one map of layout N into the entry of layout N+1 (for a per-CPU map,
// one CPU's value).
type step func(key, value []byte) (newKey, newValue []byte)

// steps[N] are the steps from layout N to N+1, by map; a map they do not name keeps its bytes.
// Only carried maps need steps.
var steps = map[int]map[string]step{
	1: {"nat_v4": dropIfindex, "nat_v6": dropIfindex},
	// Layout 3 holds addresses as byte arrays (the same bytes) so that bpftool prints them as
	// such, puts the verdict (and a reserved SNAT address) in the trie values, and adds the
	// layout record: no carried map's bytes changed.
	2: {},
	// Layout 4 adds an event (drop_untranslatable) to event_stats' key, enum event, and an
	// entry to the map: the entries there keep their keys and bytes.
	3: {},
	// Layout 5 splits each family's NAT table into confirmed flows (a hash that never evicts)
	// and unreplied ones (an LRU), with new state flags and each direction's TCP state in the
	// entries (bpf/nat.h): the entries grow by the TCP fields here, and their flags and table
	// follow from both halves when they are carried (natTableOf.carry). Its new events are
	// appended to enum event: event_stats keeps its keys.
	4: {"nat_v4": addTCPState, "nat_v6": addTCPState},
}

// addTCPState turns a layout-4 NAT entry (addr, port, kind, flags, slot, last_seen) into a
// layout-5 one: no TCP state known (no ACK, window scale unknown).
func addTCPState(key, value []byte) ([]byte, []byte) {
	tcp := make([]byte, 16)
	tcp[10] = 0xff // wscale: NAT_WSCALE_UNKNOWN
	return key, append(slices.Clip(value[:32]), tcp...)
}

// dropIfindex turns a layout-1 NAT entry (addr, port, kind, flags, slot, ifindex, pad,
// last_seen) into a layout-2 one: the write-only ifindex and its padding go.
func dropIfindex(key, value []byte) ([]byte, []byte) {
	return key, append(slices.Clip(value[:24]), value[32:40]...)
}

// upgrade turns an entry of map name from layout `from` into one of Layout.
func upgrade(name string, from int, key, value []byte) ([]byte, []byte) {
	for l := from; l < Layout; l++ {
		if s := steps[l][name]; s != nil {
			key, value = s(key, value)
		}
	}
	return key, value
}

// carry says how a map's entries go from an older layout's maps into this build's.
type carry int

const (
	// carryFlows: the NAT tables, merged flow by flow before the programs are swapped, and the
	// entries the old programs made or refreshed since each pass once more, right before the
	// swap (Migration.CatchUp) and after it (Migration.Finish).
	carryFlows carry = iota + 1
	// carryEntries: copied in every pass (the fragment tables, the openers waiting for a reply).
	carryEntries
	// carryOnce: what only userspace writes, copied before the swap (the rule slots, the
	// uplinks' addresses, the sweep totals).
	carryOnce
	// carryCounters: per-CPU 64-bit counters, copied before the swap; what the old programs
	// counted after that is added after it (for rule counters, to the slots whose rule is
	// still the same).
	carryCounters
)

// carried are the maps whose entries a migration carries over; the others start empty and are
// written by the policy sync (the tries, nat_config, nat_ports) or by Load (the layout record).
var carried = map[string]carry{
	masqMapNatV4: carryFlows, masqMapNatV6: carryFlows, masqMapNatNewV4: carryFlows, masqMapNatNewV6: carryFlows,
	masqMapKeepV4: carryEntries, masqMapKeepV6: carryEntries, masqMapPortTurns: carryOnce,
	masqMapPortAttempts: carryCounters,
	masqMapFragV4:       carryEntries, masqMapFragV6: carryEntries,
	// Connections from outside that wait for their first reply (issue 25 item 1): up to 2
	// minutes of openers, whose replies would be taken for new pod flows if they were lost.
	masqMapInboundV4: carryEntries, masqMapInboundV6: carryEntries,
	masqMapRuleSlots: carryOnce, masqMapUplinkSnat: carryOnce, masqMapSweepStats: carryOnce,
	masqMapRuleStats: carryCounters, masqMapEventStats: carryCounters,
}

// Source is the pins of an older layout, to migrate from.
type Source struct {
	// Layout is the layout of the pins (for legacy pins, the oldest of their maps', each map
	// taken for the newest layout with its shape).
	Layout int
	// Dir is where the maps are pinned: the pin root for legacy layouts, else their vN.
	Dir string
	// layouts are the maps pinned there, each with its layout.
	layouts map[string]int
	// resized is k of a directory of resized maps, vN-resized-<k> (SetAside); 0 for the pins of
	// an older layout.
	resized int
}

func (s Source) legacy() bool { return s.Layout < firstDirLayout }

// Newer tells that the source is the pins of a layout newer than this build's, which a migration
// removes unread (OpenOptions.ReplaceNewer).
func (s Source) Newer() bool { return s.Layout > Layout }

// Resized tells that the source holds maps of this build's layout set aside because their size
// changed (SetAside), rather than an older layout's.
func (s Source) Resized() bool { return s.resized > 0 }

func (s Source) String() string {
	return fmt.Sprintf("layout %d pinned under %s", s.Layout, s.Dir)
}

// Pins is what Inspect found under a pin root.
type Pins struct {
	Root string
	// Current tells that this build's layout directory exists.
	Current bool
	// Sources are the pins of older layouts and the maps set aside as resized, in the order a
	// migration merges them: older layout directories first (each before the maps set aside
	// from it, in the order they were), legacy pins at the root last (which only an older agent
	// started after a newer one, a rollback, can have made). Where two hold one key, the flow
	// seen last keeps it (see migrate.go).
	Sources []Source
	// Newer are the directories of layouts newer than this build's (a newer agent's, found
	// after a rollback), which Inspect refuses and OpenOptions.ReplaceNewer replaces; none of
	// their maps is read.
	Newer []Source
}

// Inspect reads what is pinned under root (<bpffs>/ip-masq-agent), changing nothing. It fails
// with an error wrapping ErrUnknownLayout for pins of a layout newer than Layout (Pins.Newer
// lists them), or whose layout it cannot tell. A root that does not exist holds nothing.
func Inspect(root string) (Pins, error) {
	pins, err := inspect(root)
	if err == nil && len(pins.Newer) > 0 {
		err = refuseNewer(pins.Newer[0])
	}
	return pins, err
}

// refuseNewer is the error of pins of a newer layout.
func refuseNewer(src Source) error {
	return fmt.Errorf("%w: %s holds layout %d, newer than this agent's %d: a newer agent's state, left alone",
		ErrUnknownLayout, src.Dir, src.Layout, Layout)
}

// inspect is Inspect with the pins of newer layouts listed, not refused.
func inspect(root string) (Pins, error) {
	pins := Pins{Root: root}
	entries, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return pins, nil
	}
	if err != nil {
		return pins, fmt.Errorf("read pins: %w", err)
	}
	legacy := Source{Dir: root, layouts: map[string]int{}}
	var dirs []Source
	for _, e := range entries {
		name := e.Name()
		if _, ok := legacyShapes[2][name]; ok {
			l, err := legacyLayout(filepath.Join(root, name), name)
			if err != nil {
				return pins, err
			}
			legacy.layouts[name] = l
			if legacy.Layout == 0 || l < legacy.Layout {
				legacy.Layout = l
			}
			continue
		}
		src, ok, err := layoutDir(root, e)
		switch {
		case err != nil:
			return pins, err
		case !ok: // the links' directory, a staging directory, anything else
		case src.Layout > Layout:
			pins.Newer = append(pins.Newer, src)
		case src.Layout == Layout && !src.Resized():
			pins.Current = true
		default:
			dirs = append(dirs, src)
		}
	}
	slices.SortFunc(dirs, func(a, b Source) int { return cmp.Or(a.Layout-b.Layout, a.resized-b.resized) })
	pins.Sources = dirs
	if len(legacy.layouts) > 0 {
		pins.Sources = append(pins.Sources, legacy)
	}
	return pins, nil
}

// layoutDir reads the entry e of root when it is the directory of a layout (vN) or of maps set
// aside as resized (vN-resized-k): ok false when it is neither. A newer layout's is not read.
func layoutDir(root string, e fs.DirEntry) (src Source, ok bool, err error) {
	name := e.Name()
	m := layoutDirName.FindStringSubmatch(name)
	resized := resizedDirName.FindStringSubmatch(name)
	if m == nil && resized == nil || !e.IsDir() {
		return Source{}, false, nil
	}
	src = Source{Dir: filepath.Join(root, name), layouts: map[string]int{}}
	if resized != nil {
		m = resized
		if src.resized, err = strconv.Atoi(resized[2]); err != nil {
			return src, false, fmt.Errorf("%w: %s: %v", ErrUnknownLayout, src.Dir, err)
		}
	}
	if src.Layout, err = strconv.Atoi(m[1]); err != nil {
		src.Layout = math.MaxInt // too large a number: newer than any
	}
	switch {
	case src.Layout > Layout:
		return src, true, nil
	case src.Layout < firstDirLayout:
		return src, false, fmt.Errorf("%w: %s: layout %d never had a directory", ErrUnknownLayout, src.Dir, src.Layout)
	}
	read, err := inspectDir(src.Dir, src.Layout)
	read.resized = src.resized
	return read, err == nil, err
}

// legacyLayout tells the layout of a map pinned at the root by its shape: the newest legacy
// layout whose map of that name has it.
func legacyLayout(path, name string) (int, error) {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, fmt.Errorf("%w: %s is not a pinned map: %v", ErrUnknownLayout, path, err)
	}
	defer m.Close()
	got := shapeOf(m)
	for l := firstDirLayout - 1; l >= 1; l-- {
		if legacyShapes[l][name] == got {
			return l, nil
		}
	}
	return 0, fmt.Errorf("%w: %s is a %s, which no layout's %s is", ErrUnknownLayout, path, got, name)
}

// inspectDir checks a layout directory: its record says the layout its name does, and every map
// of this build's layout pinned there has its shape (a map this build does not know is a later
// build's addition, left alone). A record that is missing (its pin removed by hand) is fine
// where the maps have their shapes: Load writes it again.
func inspectDir(dir string, layout int) (Source, error) {
	src := Source{Layout: layout, Dir: dir, layouts: map[string]int{}}
	var want map[string]mapShape
	if layout == Layout {
		want = currentShapes()
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return src, fmt.Errorf("read pins: %w", err)
	}
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return src, fmt.Errorf("%w: %s is not a pinned map: %v", ErrUnknownLayout, path, err)
		}
		got := shapeOf(m)
		if e.Name() == masqMapLayout {
			err = checkRecord(m, layout)
		}
		m.Close()
		if err != nil {
			return src, fmt.Errorf("%w: %s: %v", ErrUnknownLayout, path, err)
		}
		if s, ok := want[e.Name()]; ok && s != got {
			return src, fmt.Errorf("%w: %s is a %s, not what layout %d has", ErrUnknownLayout, path, got, layout)
		}
		src.layouts[e.Name()] = layout
	}
	return src, nil
}

// checkRecord checks a layout record.
func checkRecord(m *ebpf.Map, layout int) error {
	var rec masqLayout
	if shapeOf(m) != (mapShape{ebpf.Array, 4, uint32(unsafe.Sizeof(rec))}) {
		return fmt.Errorf("not a layout record (%s)", shapeOf(m))
	}
	if err := m.Lookup(uint32(0), &rec); err != nil {
		return fmt.Errorf("read the layout record: %w", err)
	}
	if magic := recordMagic(rec); magic != layoutMagic || int(rec.Version) != layout {
		return fmt.Errorf("the layout record says %q, layout %d; want %q, layout %d", magic, rec.Version, layoutMagic, layout)
	}
	return nil
}

func recordMagic(rec masqLayout) string {
	b := make([]byte, 0, len(rec.Magic))
	for _, c := range rec.Magic {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

func layoutRecord() masqLayout {
	rec := masqLayout{Version: Layout}
	for i, c := range []byte(layoutMagic) {
		rec.Magic[i] = int8(c)
	}
	return rec
}

// currentShapes are the shapes of this build's maps.
func currentShapes() map[string]mapShape {
	spec, err := loadMasq()
	if err != nil {
		panic(fmt.Sprintf("the embedded object does not load: %v", err)) // tests load it
	}
	out := make(map[string]mapShape, len(spec.Maps))
	for name, m := range spec.Maps {
		if !ownMap(name) {
			out[name] = mapShape{m.Type, m.KeySize, m.ValueSize}
		}
	}
	return out
}

// remove removes the source's pins: its maps' (legacy pins, by name) or its directory.
func (s Source) remove() error {
	if !s.legacy() {
		if err := os.RemoveAll(s.Dir); err != nil {
			return fmt.Errorf("remove the pins of %s: %w", s, err)
		}
		return nil
	}
	var errs []string
	for _, n := range slices.Sorted(maps.Keys(s.layouts)) {
		if err := os.Remove(filepath.Join(s.Dir, n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("remove the pins of %s: %s", s, strings.Join(errs, "; "))
	}
	return nil
}
