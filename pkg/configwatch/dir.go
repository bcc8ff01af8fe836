package configwatch

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// Dir is a config directory as a config.Source: its files whose names match a pattern, merged
// (see config.Dir.Parse). Several ConfigMaps projected into one volume (one owned by the
// platform, one by the user) are such a directory: one "..data" swap updates them together, and
// a key added or removed is a file that appears or goes away, picked up as fast as a change.
// A missing directory, or one without matching files, means the defaults.
type Dir struct {
	*watched
	dir, pattern string
	// ignored is what was last logged of the files the pattern leaves out (only the agent's
	// loop loads).
	ignored string
}

var _ config.Source = (*Dir)(nil)

// NewDir returns the source of the directory at path, reading the files that match
// opts.Config.Pattern; it touches nothing until Watch or Load.
func NewDir(path string, opts Options) (*Dir, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("config path: %w", err)
	}
	pattern := opts.Config.FilePattern()
	if err := config.CheckPattern(pattern); err != nil {
		return nil, err
	}
	sel := dirSelection{dir: abs, pattern: pattern}
	return &Dir{watched: newWatched(sel, opts), dir: abs, pattern: pattern}, nil
}

// String names the directory and the pattern: "/etc/config/ip-masq*".
func (d *Dir) String() string { return filepath.Join(d.dir, d.pattern) }

// Load implements config.Source: it reads the matching files, and merges them once each is
// whole.
func (d *Dir) Load() (config.Config, error) {
	var read config.Dir
	ws, err := d.read(func() (err error) {
		read, err = config.ReadDir(d.dir, d.pattern)
		return err
	})
	if err != nil {
		d.settle.Stop()
		return config.Config{}, err
	}
	if err := d.whole(ws, read.Files...); err != nil {
		return config.Config{}, err
	}
	d.noteIgnored(read)
	return read.Parse(d.opts.Config)
}

// noteIgnored warns, once while it lasts, of a directory whose files all miss the pattern: most
// likely a ConfigMap key named otherwise, whose configuration would silently not apply.
func (d *Dir) noteIgnored(read config.Dir) {
	ignored := ""
	if len(read.Files) == 0 && len(read.Ignored) > 0 {
		ignored = strings.Join(read.Ignored, ", ")
	}
	if ignored != "" && ignored != d.ignored {
		d.log.Warn("no file of the config directory matches the pattern; the defaults apply", "dir", d.dir,
			"pattern", d.pattern, "files", read.Ignored)
	}
	d.ignored = ignored
}

// dirSelection is the files of a directory that match a pattern, hidden ones aside (as
// config.ReadDir reads them).
type dirSelection struct{ dir, pattern string }

func (s dirSelection) selects(name string) bool {
	ok, _ := filepath.Match(s.pattern, name)
	return ok && !strings.HasPrefix(name, ".")
}

func (s dirSelection) directory() string { return s.dir }

func (s dirSelection) paths() []string {
	var out []string
	for _, name := range s.names(s.dir) {
		out = append(out, filepath.Join(s.dir, name))
	}
	return out
}

// names are the selected entries of dir, in name order; none when it cannot be read.
func (s dirSelection) names(dir string) []string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		if s.selects(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

// counts: a selected file that appears, changes or goes away.
func (s dirSelection) counts(name string) bool { return s.selects(name) }

// whole: every selected key of the new data has its link in the directory.
func (s dirSelection) whole() bool {
	have := s.names(s.dir)
	for _, name := range s.names(filepath.Join(s.dir, "..data")) {
		if !slices.Contains(have, name) {
			return false
		}
	}
	return true
}
