package agent

import (
	"errors"
	"log/slog"
	"path/filepath"

	"github.com/fsnotify/fsnotify"
)

// dirWatcher watches the directory of the config file, not the file: a ConfigMap update swaps
// the "..data" symlink, an editor renames a new file into place, and a file created later has no
// inode to watch yet. Every one of these is an event in the directory.
//
// A directory that does not exist yet (or disappears) is watched again on the next ensure; the
// periodic resync calls it, so reloads work again at the latest one resync later.
type dirWatcher struct {
	dir     string
	log     *slog.Logger
	w       *fsnotify.Watcher
	watched bool
}

func newDirWatcher(dir string, log *slog.Logger) (*dirWatcher, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	d := &dirWatcher{dir: filepath.Clean(dir), log: log, w: w}
	d.ensure()
	return d, nil
}

// ensure (re)adds the watch when the directory is not watched.
func (d *dirWatcher) ensure() {
	if d.watched {
		return
	}
	if err := d.w.Add(d.dir); err != nil {
		d.log.Warn("cannot watch the config directory; changes are picked up by the periodic resync only",
			"dir", d.dir, "error", err)
		return
	}
	d.watched = true
	d.log.Debug("watching the config directory", "dir", d.dir)
}

// relevant reports whether an event may have changed the config file, and notes the loss of the
// watch when the directory itself went away.
func (d *dirWatcher) relevant(ev fsnotify.Event) bool {
	if filepath.Clean(ev.Name) == d.dir && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		d.watched = false
		_ = d.w.Remove(d.dir) // the kernel dropped the watch already; keep fsnotify's list in step
		d.log.Warn("the config directory went away; watching it again at the next resync", "dir", d.dir)
		return true
	}
	// Attribute changes alone do not change the content.
	return ev.Op&^fsnotify.Chmod != 0
}

func (d *dirWatcher) events() <-chan fsnotify.Event { return d.w.Events }
func (d *dirWatcher) errors() <-chan error          { return d.w.Errors }

func (d *dirWatcher) close() error {
	err := d.w.Close()
	if errors.Is(err, fsnotify.ErrClosed) {
		return nil
	}
	return err
}
