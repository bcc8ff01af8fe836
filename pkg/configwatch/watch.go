package configwatch

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// dirWatcher watches the config directory, not the files: a ConfigMap update swaps the "..data"
// symlink, an editor renames a new file into place, and a file created later has no inode to
// watch yet. Every one of these is an event in the directory. When a file the source reads is a
// symlink into another directory, that directory (where the content changes) is watched too.
// Which files the source reads, and which entries of the directory matter, is its selection:
// one file, or the files of a directory that match a pattern.
//
// It also tells which files are being written: modified and not closed since. A writer that
// writes in several chunks (`cat > file` from a slow pipe, an editor writing in place) pauses
// between them; reading then would see half a document, which may well be valid. inotify's
// close-after-write event, which fsnotify does not offer, marks the end.
//
// A directory that does not exist yet (or disappears) is watched again on the next ensure; the
// periodic resync calls it, so reloads work again at the latest one resync later.
type dirWatcher struct {
	sel selection
	dir string // the config directory, as configured
	log *slog.Logger
	in  *inotify

	// dirs are the watched directories (symlinks resolved) by watch descriptor; configWD is
	// the config directory's (-1 while not watched).
	dirs     map[int32]string
	configWD int32
	// leads are, by the path of each file read, the directory its symlinks lead to (resolved)
	// and the names there that the path passes through: the file's own, and those of symlinks
	// on the way that live there. Only their events can change what the file reads; the
	// directory may be /dev or /etc, busy with other files. A path whose link leads nowhere
	// keeps its last lead, so that the event of its target's return is seen.
	leads map[string]lead
	// targets are the watches of the directories the leads name, but the config directory;
	// configNames are the names the leads name in the config directory itself.
	targets     map[int32]map[string]bool
	configNames map[string]bool
	// writing holds the files (symlinks resolved) modified and not closed since, with the time
	// of their last modification.
	writing map[string]time.Time
}

type lead struct {
	dir   string
	names map[string]bool
}

// selection is what a source reads of its config directory.
type selection interface {
	// directory is the config directory.
	directory() string
	// paths are the files the source reads now (one file's path, present or not; the
	// matching entries of a directory).
	paths() []string
	// counts tells whether an entry of the config directory with this name may change what
	// the source reads (a file appearing or going away), besides the names its paths pass
	// through and "..data".
	counts(name string) bool
	// whole tells whether, after a ConfigMap swap, every file of the new data is in place: the
	// kubelet swaps "..data" first, then makes the links of keys new to the ConfigMap.
	whole() bool
}

// dirMask: changes of entries, and content written or closed after writing. Not IN_ATTRIB:
// attributes alone do not change the content.
const dirMask = unix.IN_CREATE | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_MODIFY |
	unix.IN_CLOSE_WRITE | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR | unix.IN_EXCL_UNLINK

func newDirWatcher(sel selection, log *slog.Logger) (*dirWatcher, error) {
	in, err := newInotify()
	if err != nil {
		return nil, err
	}
	d := &dirWatcher{sel: sel, dir: filepath.Clean(sel.directory()), log: log, in: in, dirs: map[int32]string{},
		configWD: -1, leads: map[string]lead{}, targets: map[int32]map[string]bool{}, writing: map[string]time.Time{}}
	d.ensure()
	d.follow()
	return d, nil
}

// ensure (re)adds the watch of the config directory when it is not watched.
func (d *dirWatcher) ensure() {
	if d.configWD >= 0 {
		return
	}
	wd, dir, err := d.add(d.dir)
	if err != nil {
		d.log.Warn("cannot watch the config directory; changes are picked up by the periodic resync only",
			"dir", d.dir, "error", err)
		return
	}
	d.configWD = wd
	d.log.Debug("watching the config directory", "dir", dir)
	d.follow() // the leads into it count now
}

// follow watches the directories the files' symlinks lead to, and stops watching those they led
// to before. Called after every read and every change of an entry, since a ConfigMap update
// points "..data" at a new directory and a directory source may read other files now.
func (d *dirWatcher) follow() {
	paths := d.sel.paths()
	for p := range d.leads {
		if !slices.Contains(paths, p) {
			delete(d.leads, p)
		}
	}
	for _, p := range paths {
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			// A missing file, or a link whose target is gone (maybe a moment ago, its removal's
			// event still queued): keep watching where it led, so that the event is not dropped
			// with the watch and the target's return is seen too.
			continue
		}
		dir := filepath.Dir(real)
		d.leads[p] = lead{dir: dir, names: pathNames(p, dir)} // a link may have been re-pointed
	}
	configDir := ""
	if d.configWD >= 0 {
		configDir = d.dirs[d.configWD]
	}
	want := map[string]map[string]bool{}
	for _, l := range d.leads {
		if want[l.dir] == nil {
			want[l.dir] = map[string]bool{}
		}
		maps.Copy(want[l.dir], l.names)
	}
	d.configNames = want[configDir]
	delete(want, configDir)
	for wd := range d.targets {
		if names, ok := want[d.dirs[wd]]; ok {
			d.targets[wd] = names
			delete(want, d.dirs[wd])
		} else {
			d.forget(wd)
		}
	}
	for dir, names := range want {
		wd, _, err := d.add(dir)
		if err != nil {
			d.log.Debug("cannot watch the directory a config file links into", "dir", dir, "error", err)
			continue
		}
		if wd == d.configWD {
			// The same directory under another name.
			d.configNames = maps.Clone(d.configNames)
			if d.configNames == nil {
				d.configNames = map[string]bool{}
			}
			maps.Copy(d.configNames, names)
			continue
		}
		d.targets[wd] = names
		d.log.Debug("watching the directory a config file links into", "dir", dir)
	}
}

// pathNames returns the names in dir (symlinks resolved) that path passes through on its way to
// the file: the file's own, and those of the symlinks on the way that live in dir.
func pathNames(path, dir string) map[string]bool {
	names := map[string]bool{}
	for range 40 { // as many links as the kernel follows
		if parent, err := filepath.EvalSymlinks(filepath.Dir(path)); err == nil && parent == dir {
			names[filepath.Base(path)] = true
		}
		target, err := os.Readlink(path)
		if err != nil {
			break // the file itself (or gone)
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(filepath.Dir(path), target)
		}
		path = target
	}
	return names
}

func (d *dirWatcher) add(dir string) (int32, string, error) {
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return -1, "", err
	}
	wd, err := d.in.add(real, dirMask)
	if err != nil {
		return -1, "", err
	}
	d.dirs[wd] = real
	return wd, real, nil
}

// forget removes a watch and what was known about its directory.
func (d *dirWatcher) forget(wd int32) {
	d.in.remove(wd)
	d.dropDir(wd)
}

func (d *dirWatcher) dropDir(wd int32) {
	dir := d.dirs[wd]
	delete(d.dirs, wd)
	delete(d.targets, wd)
	for p := range d.writing {
		if filepath.Dir(p) == dir {
			delete(d.writing, p)
		}
	}
}

// handle records what an event says about writers and lost watches, and reports whether it may
// have changed what the source reads.
func (d *dirWatcher) handle(ev inotifyEvent) bool {
	if ev.mask&unix.IN_Q_OVERFLOW != 0 {
		// Events were lost, close events among them: start over.
		clear(d.writing)
		return true
	}
	dir, ok := d.dirs[ev.wd]
	if !ok {
		return false // a watch removed meanwhile
	}
	if ev.mask&(unix.IN_IGNORED|unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
		if ev.mask&unix.IN_IGNORED != 0 {
			d.dropDir(ev.wd) // the kernel dropped the watch
		} else {
			d.forget(ev.wd)
		}
		if ev.wd == d.configWD {
			d.configWD = -1
			d.log.Warn("the config directory went away; watching it again at the next resync", "dir", d.dir)
		}
		// A target directory gone is the old data of a ConfigMap update; follow finds the new one.
		return true
	}
	p := filepath.Join(dir, ev.name)
	switch {
	case ev.mask&unix.IN_MODIFY != 0:
		d.writing[p] = time.Now()
	case ev.mask&(unix.IN_CLOSE_WRITE|unix.IN_DELETE|unix.IN_MOVED_FROM) != 0:
		delete(d.writing, p)
	}
	if names, ok := d.targets[ev.wd]; ok {
		return names[ev.name] // not another file of a directory a config file links into
	}
	// In the config directory: the kubelet's own entries around a ConfigMap update (the
	// "..<timestamp>" data directories, "..data_tmp") change nothing that is read until
	// "..data" is swapped; the old data directory's removal after the swap would otherwise read
	// the files a second time.
	return ev.name == "..data" || d.configNames[ev.name] || d.sel.counts(ev.name)
}

// swapped reports whether ev completed a ConfigMap update: "..data" renamed into the config
// directory (the kubelet's atomic swap, after the new content is written whole) while every
// file of the new data is in place. Such a change needs no debounce. Without the files (the
// first projection of a key, whose symlink the kubelet creates after the swap) the debounce
// waits for them, rather than reading a missing file as the defaults.
func (d *dirWatcher) swapped(ev inotifyEvent) bool {
	if ev.wd != d.configWD || ev.mask&unix.IN_MOVED_TO == 0 || ev.name != "..data" {
		return false
	}
	return d.sel.whole()
}

// writers returns the files being written now.
func (d *dirWatcher) writers() writers { return maps.Clone(d.writing) }

// writers are the files being written (symlinks resolved), with the time of their last
// modification.
type writers map[string]time.Time

// of reports whether the file at path (symlinks resolved) is being written, and when it was last
// modified.
func (w writers) of(path string) (bool, time.Time) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return false, time.Time{}
	}
	at, ok := w[real]
	return ok, at
}

func (d *dirWatcher) events() <-chan inotifyEvent { return d.in.events }
func (d *dirWatcher) errors() <-chan error        { return d.in.errors }

func (d *dirWatcher) close() error { return d.in.close() }

// inotify is an inotify instance read by a goroutine.
type inotify struct {
	fd     int
	f      *os.File
	events chan inotifyEvent
	errors chan error
	done   chan struct{}
	once   sync.Once
}

type inotifyEvent struct {
	wd   int32
	mask uint32
	name string
}

func (ev inotifyEvent) String() string {
	var ops []string
	for _, o := range []struct {
		bit  uint32
		name string
	}{{unix.IN_CREATE, "create"}, {unix.IN_DELETE, "delete"}, {unix.IN_MOVED_FROM, "moved-from"},
		{unix.IN_MOVED_TO, "moved-to"}, {unix.IN_MODIFY, "modify"}, {unix.IN_CLOSE_WRITE, "close-write"},
		{unix.IN_DELETE_SELF, "delete-self"}, {unix.IN_MOVE_SELF, "move-self"}, {unix.IN_IGNORED, "ignored"},
		{unix.IN_Q_OVERFLOW, "overflow"}} {
		if ev.mask&o.bit != 0 {
			ops = append(ops, o.name)
		}
	}
	return fmt.Sprintf("%q: %s", ev.name, strings.Join(ops, "|"))
}

func newInotify() (*inotify, error) {
	// Non-blocking, so that reads go through the runtime poller and close ends them.
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	in := &inotify{fd: fd, f: os.NewFile(uintptr(fd), "inotify"), events: make(chan inotifyEvent, 64),
		errors: make(chan error, 1), done: make(chan struct{})}
	go in.read()
	return in, nil
}

func (in *inotify) add(dir string, mask uint32) (int32, error) {
	wd, err := unix.InotifyAddWatch(in.fd, dir, mask)
	if err != nil {
		return -1, fmt.Errorf("inotify_add_watch %s: %w", dir, err)
	}
	return int32(wd), nil
}

func (in *inotify) remove(wd int32) {
	_, _ = unix.InotifyRmWatch(in.fd, uint32(wd)) // fails when the kernel dropped it already
}

func (in *inotify) read() {
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	for {
		n, err := in.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) && !errors.Is(err, io.EOF) {
				select {
				case in.errors <- fmt.Errorf("read inotify events: %w", err):
				case <-in.done:
				}
			}
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			b := buf[off:n]
			ev := inotifyEvent{wd: int32(binary.NativeEndian.Uint32(b)), mask: binary.NativeEndian.Uint32(b[4:])}
			nameLen := int(binary.NativeEndian.Uint32(b[12:]))
			if unix.SizeofInotifyEvent+nameLen > len(b) {
				break // cannot happen: the kernel writes whole events
			}
			ev.name = strings.TrimRight(string(b[unix.SizeofInotifyEvent:unix.SizeofInotifyEvent+nameLen]), "\x00")
			off += unix.SizeofInotifyEvent + nameLen
			if ev.mask&unix.IN_Q_OVERFLOW != 0 {
				select {
				case in.errors <- errors.New("inotify queue overflow: events were lost"):
				case <-in.done:
					return
				default: // one pending overflow says it all
				}
			}
			select {
			case in.events <- ev:
			case <-in.done:
				return
			}
		}
	}
}

func (in *inotify) close() error {
	var err error
	in.once.Do(func() {
		close(in.done)
		err = in.f.Close()
	})
	return err
}
