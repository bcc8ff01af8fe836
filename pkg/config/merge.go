package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// DefaultPattern selects the files of a config directory that are read, as Azure's
// ip-masq-agent-v2 does: every file whose name starts with "ip-masq".
const DefaultPattern = "ip-masq*"

// CheckPattern checks a --config-pattern: a glob on file names (filepath.Match), so no "/".
func CheckPattern(pattern string) error {
	if pattern == "" || strings.ContainsRune(pattern, '/') {
		return fmt.Errorf("config-pattern %q: want a glob on file names such as %q, without '/'", pattern, DefaultPattern)
	}
	if _, err := filepath.Match(pattern, ""); err != nil {
		return fmt.Errorf("config-pattern %q: %w", pattern, err)
	}
	return nil
}

// IsDir tells whether --config names a directory of files to merge rather than one file: a
// directory that exists (symlinks followed), or a path that ends in "/" (a directory that may
// appear later).
func IsDir(path string) bool {
	if strings.HasSuffix(path, "/") {
		return true
	}
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

// Dir is one read of a config directory.
type Dir struct {
	Path string
	// Files are the entries read, in name order (see ReadDir).
	Files []File
	// Ignored are the names of the entries that do not match the pattern (hidden ones aside).
	Ignored []string
}

// ReadDir reads the files of dir whose names match pattern, in name order. Hidden entries (a
// name that starts with ".", such as the kubelet's "..data" and an editor's swap files) and
// entries that lead to a directory are skipped, and so is an entry whose file is gone (a
// dangling symlink, the kubelet's removal of a key in progress). A missing directory has no
// files: the defaults apply, as for a missing file.
func ReadDir(dir, pattern string) (Dir, error) {
	out := Dir{Path: dir}
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return out, fmt.Errorf("read config directory %s: %w", dir, err)
	}
	for _, e := range entries { // sorted by name
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			continue
		}
		if ok, _ := filepath.Match(pattern, name); !ok {
			out.Ignored = append(out.Ignored, name)
			continue
		}
		path := filepath.Join(dir, name)
		if fi, err := os.Stat(path); err == nil && fi.IsDir() {
			continue
		}
		f, err := ReadFile(path)
		if err != nil {
			return out, err
		}
		if !f.Missing {
			out.Files = append(out.Files, f)
		}
	}
	return out, nil
}

// Names are the names of the files read, for messages.
func (d Dir) Names() []string {
	out := make([]string, len(d.Files))
	for i, f := range d.Files {
		out[i] = filepath.Base(f.Path)
	}
	return out
}

// Parse merges the files' documents into one configuration, in name order:
//   - a key that no file sets keeps its default;
//   - lists are concatenated, file after file, and an entry that an earlier file lists already
//     is dropped (a file's own repeats stay, as they would in a single file);
//   - every other key must have the same value in every file that sets it: files that
//     disagree are an error naming both (see ConflictError);
//   - the merged configuration is validated as a whole: cidrLimit applies to the merged list.
//
// Every file's problems are reported, each naming its file. No file means the defaults.
func (d Dir) Parse(opts Options) (Config, error) {
	parts := make([]part, 0, len(d.Files))
	var errs []error
	for _, f := range d.Files {
		cfg, set, err := parseDocument(f.Data, opts)
		if err != nil {
			errs = append(errs, fmt.Errorf("config %s: %w", f.Path, err))
			continue
		}
		parts = append(parts, part{name: filepath.Base(f.Path), cfg: cfg, set: set})
	}
	if err := errors.Join(errs...); err != nil {
		return Config{}, err
	}
	merged := Default(opts)
	for _, k := range Keys {
		var setters []part
		for _, p := range parts {
			if !p.set[k.Name] {
				continue
			}
			if len(setters) == 0 {
				k.copyFrom(&merged, &p.cfg)
			} else if conf := k.merge(&merged, &p.cfg); conf != nil {
				errs = append(errs, conflictError(k, setters, p, conf))
			}
			setters = append(setters, p)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return Config{}, fmt.Errorf("config %s: %w", d.Path, err)
	}
	if err := merged.validate(); err != nil {
		return Config{}, fmt.Errorf("config %s (merged from %s): %w", d.Path, strings.Join(d.Names(), ", "), err)
	}
	return merged, nil
}

// part is one file's document, decoded.
type part struct {
	name string
	cfg  Config
	set  map[string]bool
}

// conflictError names the earlier file that holds what later disagrees with: the first of the
// setters whose own value conflicts with it.
func conflictError(k Key, setters []part, later part, conf *conflict) *ConflictError {
	earlier := setters[0]
	for _, s := range setters {
		own := s.cfg
		if k.merge(&own, &later.cfg) != nil {
			earlier = s
			break
		}
	}
	return &ConflictError{Key: k.Name, Entry: conf.Entry, Files: [2]string{earlier.name, later.name},
		Values: [2]string{conf.Have, conf.Got}}
}

// ConflictError is two files of a config directory that set a key to values that cannot be
// merged: two values of a key that is not a list, or list entries that contradict each other.
type ConflictError struct {
	Key string
	// Entry is the later file's list entry that disagrees, or -1.
	Entry int
	// Files are the earlier and the later file's names; Values what each says.
	Files, Values [2]string
}

func (e *ConflictError) Error() string {
	key := e.Key
	if e.Entry >= 0 {
		key = fmt.Sprintf("%s[%d]", e.Key, e.Entry)
	}
	return fmt.Sprintf("%s: %s in %s conflicts with %s in %s; the files of a config directory must agree on it",
		key, quote(e.Values[1]), e.Files[1], quote(e.Values[0]), e.Files[0])
}
