// Package configwatch loads the agent's configuration from files and tells when it changes
// (config.Source): the watch of the file's directory, ConfigMap swaps and files being written.
package configwatch

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// Defaults of Options.
const (
	// DefaultDebounce lets a burst of directory events (a ConfigMap swap is several) settle into
	// one reload, while keeping a change well under a second from file to datapath.
	DefaultDebounce = 20 * time.Millisecond
	// DefaultQuiet is how long a file must be unmodified before it is read as whole: a writer
	// that writes in several chunks pauses between them (see Options.Quiet).
	DefaultQuiet = 100 * time.Millisecond
	// DefaultWriterTimeout bounds the wait for a writer that keeps the file open.
	DefaultWriterTimeout = 30 * time.Second
)

// Options configure a File.
type Options struct {
	// Config says how the file is read.
	Config config.Options
	// Logger receives the watch's logs; nil discards them.
	Logger *slog.Logger
	// Debounce is how long the config directory must stay quiet before the file is re-read.
	Debounce time.Duration
	// Quiet and WriterTimeout keep a file that is being written from being applied half-read.
	// A file is read as whole only when no writer has it open (a modification seen and no
	// close after it; for at most WriterTimeout since the last modification, after which the
	// writer is taken for stalled), it did not change during the read, and it was last
	// modified at least Quiet ago; otherwise it is read again shortly. A ConfigMap update
	// replaces the file whole, so it only waits out Quiet from the kubelet's write.
	Quiet, WriterTimeout time.Duration
}

// File is a configuration file as a config.Source: a missing file means the defaults.
type File struct {
	path string // absolute, so that watch events and the file's resolved path compare
	opts Options
	log  *slog.Logger

	mu      sync.Mutex
	w       *dirWatcher // nil before Watch
	changes chan struct{}
	stopped bool
	// settle reads again a file that was being written.
	settle *time.Timer
}

var _ config.Source = (*File)(nil)

// NewFile returns the source of the file at path; it touches nothing until Watch or Load.
func NewFile(path string, opts Options) (*File, error) {
	if path == "" {
		return nil, fmt.Errorf("no config path")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("config path: %w", err)
	}
	if opts.Debounce <= 0 {
		opts.Debounce = DefaultDebounce
	}
	if opts.Quiet <= 0 {
		opts.Quiet = DefaultQuiet
	}
	if opts.WriterTimeout <= 0 {
		opts.WriterTimeout = DefaultWriterTimeout
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	f := &File{path: abs, opts: opts, log: log.With("component", "config"), changes: make(chan struct{}, 1)}
	f.settle = time.AfterFunc(time.Hour, f.notify)
	f.settle.Stop()
	return f, nil
}

func (f *File) String() string { return f.path }

// Watch implements config.Source.
func (f *File) Watch(ctx context.Context) (<-chan struct{}, error) {
	w, err := newDirWatcher(f.path, f.log)
	if err != nil {
		return nil, fmt.Errorf("watch config directory: %w", err)
	}
	f.mu.Lock()
	f.w = w
	f.mu.Unlock()
	go f.watch(ctx, w)
	return f.changes, nil
}

// watch turns the directory's events into changes: a ConfigMap swap at once, anything else once
// the directory stayed quiet for Debounce.
func (f *File) watch(ctx context.Context, w *dirWatcher) {
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer func() {
		debounce.Stop()
		f.mu.Lock()
		f.stopped = true
		f.settle.Stop()
		close(f.changes)
		f.mu.Unlock()
		w.close()
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-w.events():
			f.mu.Lock()
			changed := w.handle(ev)
			swapped := changed && w.swapped(ev)
			if changed && ev.mask&(unix.IN_MODIFY|unix.IN_CLOSE_WRITE) == 0 {
				// An entry changed, maybe a link on the way to the file (a ConfigMap swap):
				// watch where it leads now, and no longer where it led, so that the removal
				// of the old data directory that follows a swap reads nothing again.
				w.follow()
			}
			f.mu.Unlock()
			if !changed {
				continue
			}
			f.log.Debug("config directory changed", "event", ev.String())
			if swapped {
				debounce.Stop()
				f.notify()
			} else {
				debounce.Reset(f.opts.Debounce)
			}
		case err := <-w.errors():
			// Events may have been lost (a queue overflow): read again to be sure.
			f.log.Warn("config directory watch error; re-reading the file", "error", err)
			debounce.Reset(f.opts.Debounce)
		case <-debounce.C:
			f.notify()
		}
	}
}

// notify reports a change; one pending report stands for any number.
func (f *File) notify() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return
	}
	select {
	case f.changes <- struct{}{}:
	default:
	}
}

// Load implements config.Source: it reads the file, and parses it once it is whole.
func (f *File) Load() (config.Config, error) {
	f.mu.Lock()
	var writing bool
	var lastWrite time.Time
	if f.w != nil {
		f.w.ensure() // the directory may be back after it went away
		writing, lastWrite = f.w.writer()
	}
	f.mu.Unlock()
	file, err := config.ReadFile(f.path)
	f.mu.Lock()
	if f.w != nil {
		f.w.follow() // a ConfigMap update points the file at a new directory
	}
	f.mu.Unlock()
	if err != nil {
		f.settle.Stop()
		return config.Config{}, err
	}
	if again, reason := f.unsettled(file, writing, lastWrite, time.Now()); again > 0 {
		f.log.Debug("the config file is being written; reading it again shortly", "path", f.path,
			"reason", reason, "in", again)
		f.settle.Reset(again)
		return config.Config{}, fmt.Errorf("config %s: %w: %s", f.path, config.ErrUnsettled, reason)
	}
	f.settle.Stop()
	if writing {
		f.log.Warn("the config file is still open for writing but unmodified for a while; reading it as it is",
			"path", f.path, "lastWrite", lastWrite)
	}
	return file.Parse(f.opts.Config)
}

// unsettled tells whether a read of the config file may have caught it half-written, and if so
// when to read it again. A missing file is settled: a ConfigMap update or an editor replaces
// the file whole, by a rename.
func (f *File) unsettled(file config.File, writing bool, lastWrite, now time.Time) (time.Duration, string) {
	if file.Missing {
		return 0, ""
	}
	if writing {
		if left := f.opts.WriterTimeout - now.Sub(lastWrite); left > 0 {
			// The close after the last write is an event that reads it sooner.
			return left, "a writer has it open"
		}
	}
	if file.Torn {
		return f.opts.Quiet, "it changed while it was read"
	}
	if file.Published {
		return 0, "" // a ConfigMap's files are complete before they appear
	}
	// An mtime in the future (a clock step, a copied timestamp) says nothing about writers.
	if age := now.Sub(file.ModTime); age >= 0 && age < f.opts.Quiet {
		return f.opts.Quiet - age, "it was modified " + age.Round(time.Millisecond).String() + " ago"
	}
	return 0, ""
}
