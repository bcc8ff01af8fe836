package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

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
		if ownMap(name) {
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

// PinMismatch is a map pinned under LoadOptions.PinPath whose layout differs from what Load
// would create (another size, key or value), so Load cannot reuse it.
type PinMismatch struct {
	Map string
	// Reason says what differs, e.g. "MaxEntries: 1024 changed to 262144".
	Reason string
}

// CheckPins compares the maps pinned under opts.PinPath with those Load(opts) would create, and
// returns the ones that differ. A map that is not pinned is not a mismatch: Load creates it.
// Removing the pins of the mismatches (RemovePins), or setting them aside so that a migration
// carries their entries (SetAside), lets Load replace just those maps, keeping the rest.
func CheckPins(opts LoadOptions) ([]PinMismatch, error) {
	opts = opts.withDefaults()
	if opts.PinPath == "" {
		return nil, nil
	}
	spec, err := opts.spec()
	if err != nil {
		return nil, err
	}
	var out []PinMismatch
	for _, name := range MapNames() {
		m, err := ebpf.LoadPinnedMap(filepath.Join(opts.PinPath, name), nil)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		cerr := spec.Maps[name].Compatible(m)
		m.Close()
		if errors.Is(cerr, ebpf.ErrMapIncompatible) {
			out = append(out, PinMismatch{Map: name, Reason: strings.TrimSuffix(cerr.Error(), ": "+ebpf.ErrMapIncompatible.Error())})
		} else if cerr != nil {
			return nil, fmt.Errorf("compare pinned map %s: %w", name, cerr)
		}
	}
	return out, nil
}

// RemovePins removes the pins of the named maps under dir; pins already gone are fine. Maps
// still in use (by attached programs) live on until those let go of them.
func RemovePins(dir string, names ...string) error {
	for _, name := range names {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove pin of %s: %w", name, err)
		}
	}
	return nil
}

// SetAside moves the pins of the named maps of dir, a layout directory (LayoutDir), into a
// directory of resized maps beside it, <dir>-resized-<k> with the first k not in use, and
// returns that directory. Load then makes those maps anew, and Inspect reports the directory as
// a source of dir's layout, whose entries a migration carries into the new maps before it
// removes it; the programs attached meanwhile keep the set-aside maps, as with an older
// layout's. A directory of resized maps is never written to again: maps set aside later, even
// of the same names, go to a directory of their own, merged after it.
func SetAside(dir string, names ...string) (string, error) {
	to := ""
	for k := 1; ; k++ {
		to = dir + "-resized-" + strconv.Itoa(k)
		if _, err := os.Stat(to); errors.Is(err, fs.ErrNotExist) {
			break
		} else if err != nil {
			return "", fmt.Errorf("set aside resized maps: %w", err)
		}
	}
	if err := os.Mkdir(to, 0o700); err != nil {
		return "", fmt.Errorf("set aside resized maps: %w", err)
	}
	for _, name := range names {
		if err := os.Rename(filepath.Join(dir, name), filepath.Join(to, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return to, fmt.Errorf("set aside resized map %s: %w", name, err)
		}
	}
	return to, nil
}

// RemovePinned removes every pin under root, the maps of every layout with them (they live on
// while programs or descriptors hold them), and tells whether there was anything. Pins are
// touched only where root is on a BPF filesystem.
func RemovePinned(root string) (bool, error) {
	if _, err := os.Stat(root); errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err := CheckBPFFS(filepath.Dir(root)); err != nil {
		return false, fmt.Errorf("leave %s alone: %w", root, err)
	}
	if err := os.RemoveAll(root); err != nil {
		return false, fmt.Errorf("remove BPF pins: %w", err)
	}
	return true, nil
}

// CheckBPFFS checks that dir is a writable BPF filesystem.
func CheckBPFFS(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("--bpffs %s: %w", dir, err)
	}
	if uint32(st.Type) != bpfFSMagic {
		return fmt.Errorf("--bpffs %s is not a BPF filesystem (filesystem magic %#x); mount one there (mount -t bpf bpf %s) or give another --bpffs", dir, uint32(st.Type), dir)
	}
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return fmt.Errorf("--bpffs %s is not writable: %w", dir, err)
	}
	return nil
}
