package testutil

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// Projection is a directory updated the way the kubelet publishes a ConfigMap volume, or a
// projected volume of several ConfigMaps (its AtomicWriter): each version of the files is
// written whole into a fresh "..<timestamp>" directory, "..data" is switched to it by an atomic
// rename, then a link "<key> -> ..data/<key>" is made for each key new to this version, the
// links of the keys it no longer has are removed, and so is the previous version's directory.
type Projection struct {
	Dir string
	// Swapped is when the last Write switched "..data" to its version: the instant a watcher
	// can see it, for benchmarks that time from there (Write returns later, after the links
	// and the removal of the previous version).
	Swapped time.Time
	n       int
	prev    string            // the previous version's directory
	keys    map[string]string // the keys published
}

// NewProjection returns an empty projection in dir, which must exist.
func NewProjection(dir string) *Projection { return &Projection{Dir: dir} }

// Path is the path of a key's file.
func (p *Projection) Path(key string) string { return filepath.Join(p.Dir, key) }

// Write publishes files (key to content) as the next version.
func (p *Projection) Write(files map[string]string) error {
	p.n++
	version := fmt.Sprintf("..2026_01_01_00_00_00.%d", p.n)
	if err := os.Mkdir(filepath.Join(p.Dir, version), 0o755); err != nil {
		return err
	}
	for _, key := range slices.Sorted(maps.Keys(files)) {
		if err := os.WriteFile(filepath.Join(p.Dir, version, key), []byte(files[key]), 0o644); err != nil {
			return err
		}
	}
	tmp := filepath.Join(p.Dir, "..data_tmp")
	if err := os.Symlink(version, tmp); err != nil {
		return err
	}
	swapped := time.Now()
	if err := os.Rename(tmp, filepath.Join(p.Dir, "..data")); err != nil {
		return err
	}
	p.Swapped = swapped
	for _, key := range slices.Sorted(maps.Keys(files)) {
		if _, err := os.Lstat(p.Path(key)); errors.Is(err, os.ErrNotExist) {
			if err := os.Symlink(filepath.Join("..data", key), p.Path(key)); err != nil {
				return err
			}
		}
	}
	for key := range p.keys {
		if _, ok := files[key]; !ok {
			if err := os.Remove(p.Path(key)); err != nil {
				return err
			}
		}
	}
	if p.prev != "" {
		if err := os.RemoveAll(filepath.Join(p.Dir, p.prev)); err != nil {
			return err
		}
	}
	p.prev, p.keys = version, maps.Clone(files)
	return nil
}
