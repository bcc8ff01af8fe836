package bpf

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// checkBudget bounds the trie entries CheckPolicy looks up in one call: a policy of the usual
// size (tens of rules) is looked at whole every time, a huge one in turns (100k entries in
// about 7 minutes at one call a second), at well under a millisecond per call.
const checkBudget = 256

// trieEntry is one entry the last sync wrote into a trie.
type trieEntry struct {
	trie   string
	prefix netip.Prefix
	slot   uint32
}

// checkState is what CheckPolicy keeps between calls (guarded by Datapath.mu).
type checkState struct {
	// entries are the tries' entries as the last sync left them, in a fixed order; next is where
	// the following call continues.
	entries []trieEntry
	next    int
	// config is the nat_config the last sync wrote.
	config masqNatConfig
	// elemSize is, by trie key size, how many bytes of memlock one entry adds (0: the kernel
	// does not report a trie's size, see trieEntryCount).
	elemSize map[uint32]uint64
}

// snapshotChecks records what CheckPolicy compares with, after a sync.
func (d *Datapath) snapshotChecks(cfg masqNatConfig) {
	d.check.config = cfg
	d.check.entries = d.check.entries[:0]
	for _, name := range trieNames {
		start := len(d.check.entries)
		for p, s := range d.tries[name] {
			d.check.entries = append(d.check.entries, trieEntry{name, p, s})
		}
		slices.SortFunc(d.check.entries[start:], func(a, b trieEntry) int {
			return cmp.Or(a.prefix.Addr().Compare(b.prefix.Addr()), cmp.Compare(a.prefix.Bits(), b.prefix.Bits()))
		})
	}
	d.check.next = 0
}

// CheckPolicy tells, cheaply enough to ask every second, whether the maps that decide verdicts
// still hold what the last SyncPolicy wrote, and returns the names of those that do not: a trie
// name (masq_v4, nomasq_v4, masq_v6, nomasq_v6) or nat_config. Nothing before the first sync.
//
//   - Each trie's entry count is compared with the synced one: on kernels that report a map's
//     memory use (Linux 6.4+, where an LPM trie's is its entry count times a fixed size), an
//     entry deleted or added behind the agent's back is caught at the next call.
//   - Up to checkBudget synced entries are looked up in turns, exactly: an entry whose slot
//     changed, or that is gone (also on kernels without the count), is caught within
//     len(entries)/checkBudget calls.
//   - nat_config is compared whole.
//
// The port table (nat_ports) is not checked.
func (d *Datapath) CheckPolicy() ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.synced == nil {
		return nil, nil
	}
	var drifted []string
	mark := func(name string) {
		if !slices.Contains(drifted, name) {
			drifted = append(drifted, name)
		}
	}
	for _, name := range trieNames {
		n, ok, err := d.trieEntryCount(d.trieMap(name))
		if err != nil {
			return nil, fmt.Errorf("check %s: %w", name, err)
		}
		if ok && n != uint64(len(d.tries[name])) {
			mark(name)
		}
	}
	entries := d.check.entries
	for i := range min(checkBudget, len(entries)) {
		e := entries[(d.check.next+i)%len(entries)]
		var v masqLpmVal
		var err error
		// Keys by pointer: the library copies those without reflection.
		if e.prefix.Addr().Is4() {
			k := masqLpm4Key{Prefixlen: uint32(e.prefix.Bits()), Addr: addr4Word(e.prefix.Addr())}
			err = d.trieMap(e.trie).Lookup(&k, &v)
		} else {
			k := masqLpm6Key{Prefixlen: uint32(e.prefix.Bits()), Addr: addr6Words(e.prefix.Addr())}
			err = d.trieMap(e.trie).Lookup(&k, &v)
		}
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			mark(e.trie)
		case err != nil:
			return nil, fmt.Errorf("check %s: %w", e.trie, err)
		case v.Slot != e.slot:
			// An exact-length lookup finds the entry itself while it exists; another slot means
			// it changed, or is gone and a shorter prefix with another rule answered.
			mark(e.trie)
		}
	}
	if len(entries) > 0 {
		d.check.next = (d.check.next + checkBudget) % len(entries)
	}
	var cfg masqNatConfig
	if err := d.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		return nil, fmt.Errorf("check nat_config: %w", err)
	}
	if cfg != d.check.config {
		mark(masqMapNatConfig)
	}
	slices.SortFunc(drifted, func(a, b string) int { return slices.Index(checkOrder, a) - slices.Index(checkOrder, b) })
	return drifted, nil
}

var checkOrder = append(slices.Clone(trieNames), masqMapNatConfig)

// trieEntryCount returns how many entries an LPM trie holds, read from the memory use the
// kernel reports for the map (/proc/self/fdinfo: one read, whatever the size; a walk of 100k
// entries takes tens of milliseconds). ok is false where the kernel does not report it.
func (d *Datapath) trieEntryCount(m *ebpf.Map) (n uint64, ok bool, err error) {
	if d.check.elemSize == nil {
		d.check.elemSize = map[uint32]uint64{}
	}
	size, probed := d.check.elemSize[m.KeySize()]
	if !probed {
		size = probeTrieElemSize(m.KeySize(), m.ValueSize())
		d.check.elemSize[m.KeySize()] = size
	}
	if size == 0 {
		return 0, false, nil
	}
	used, err := memlock(m)
	if err != nil {
		return 0, false, err
	}
	if used%size != 0 {
		return 0, false, nil
	}
	return used / size, true, nil
}

// probeTrieElemSize finds what one entry adds to the memory a trie with these key and value
// sizes reports, with a throwaway trie: since Linux 6.4 a trie reports its entries times a fixed
// size, before that a constant. It returns 0 when the report does not count entries.
func probeTrieElemSize(keySize, valueSize uint32) uint64 {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: keySize, ValueSize: valueSize,
		MaxEntries: 2, Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		return 0
	}
	defer m.Close()
	var used [3]uint64
	for i := range used {
		if i > 0 {
			key := make([]byte, keySize)
			binary.NativeEndian.PutUint32(key, uint32(8*i)) // 0/8, then 0/16: two entries
			if err := m.Put(key, make([]byte, valueSize)); err != nil {
				return 0
			}
		}
		if used[i], err = memlock(m); err != nil {
			return 0
		}
	}
	if used[0] != 0 || used[1] == 0 || used[2] != 2*used[1] {
		return 0
	}
	return used[1]
}

// memlock reads the memory use the kernel reports for a map (0 when it reports none).
func memlock(m *ebpf.Map) (uint64, error) {
	info, err := m.Info()
	if err != nil {
		return 0, fmt.Errorf("map info: %w", err)
	}
	n, _ := info.Memlock()
	return n, nil
}

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
