// Package configwatch loads the agent's configuration from files and tells when it changes
// (config.Source): one file (File) or the files of a directory merged (Dir); the watch of the
// config directory, ConfigMap swaps and files being written.
package configwatch

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
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

// Options configure a File or a Dir.
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

// watched is what every source of this package shares: the watch of its config directory, the
// reports of changes, and the re-read of files that were being written.
type watched struct {
	sel  selection
	opts Options
	log  *slog.Logger

	mu      sync.Mutex
	w       *dirWatcher // nil before Watch
	changes *config.Changes
	// settle reads again a file that was being written.
	settle *time.Timer
}

func newWatched(sel selection, opts Options) *watched {
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
	w := &watched{sel: sel, opts: opts, log: log.With("component", "config"), changes: config.NewChanges()}
	w.settle = time.AfterFunc(time.Hour, w.changes.Notify)
	w.settle.Stop()
	return w
}

// New returns the source of the configuration at path: a Dir when path names a directory
// (config.IsDir), else a File. It touches nothing until Watch or Load.
func New(path string, opts Options) (config.Source, error) {
	if path != "" && config.IsDir(path) {
		return NewDir(path, opts)
	}
	return NewFile(path, opts)
}

// File is a configuration file as a config.Source: a missing file means the defaults.
type File struct {
	*watched
	path string // absolute, so that watch events and the file's resolved path compare
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
	return &File{watched: newWatched(fileSelection(abs), opts), path: abs}, nil
}

func (f *File) String() string { return f.path }

// Load implements config.Source: it reads the file, and parses it once it is whole.
func (f *File) Load() (config.Config, error) {
	var file config.File
	ws, err := f.read(func() (err error) {
		file, err = config.ReadFile(f.path)
		return err
	})
	if err != nil {
		f.settle.Stop()
		return config.Config{}, err
	}
	if err := f.whole(ws, file); err != nil {
		return config.Config{}, err
	}
	return file.Parse(f.opts.Config)
}

// fileSelection is one file.
type fileSelection string

func (s fileSelection) directory() string { return filepath.Dir(string(s)) }
func (s fileSelection) paths() []string   { return []string{string(s)} }

// counts: every entry but the kubelet's own ("..<timestamp>", "..data_tmp"); the file's
// symlinks may pass through any of them.
func (s fileSelection) counts(name string) bool {
	return !strings.HasPrefix(name, "..") || name == filepath.Base(string(s))
}

func (s fileSelection) whole() bool {
	_, err := os.Stat(string(s))
	return err == nil
}

// Watch implements config.Source.
func (s *watched) Watch(ctx context.Context) (<-chan struct{}, error) {
	w, err := newDirWatcher(s.sel, s.log)
	if err != nil {
		return nil, fmt.Errorf("watch config directory: %w", err)
	}
	s.mu.Lock()
	s.w = w
	s.mu.Unlock()
	go s.watch(ctx, w)
	return s.changes.C(), nil
}

// watch turns the directory's events into changes: a ConfigMap swap at once, anything else once
// the directory stayed quiet for Debounce.
func (s *watched) watch(ctx context.Context, w *dirWatcher) {
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer func() {
		debounce.Stop()
		s.settle.Stop()
		s.changes.Stop()
		w.close()
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-w.events():
			s.mu.Lock()
			changed := w.handle(ev)
			swapped := changed && w.swapped(ev)
			if changed && ev.mask&(unix.IN_MODIFY|unix.IN_CLOSE_WRITE) == 0 {
				// An entry changed, maybe a link on the way to a file (a ConfigMap swap), or
				// a file of a directory source appeared: watch where the links lead now, and
				// no longer where they led, so that the removal of the old data directory
				// that follows a swap reads nothing again.
				w.follow()
			}
			s.mu.Unlock()
			if !changed {
				continue
			}
			s.log.Debug("config directory changed", "event", ev.String())
			if swapped {
				debounce.Stop()
				s.changes.Notify()
			} else {
				debounce.Reset(s.opts.Debounce)
			}
		case err := <-w.errors():
			// Events may have been lost (a queue overflow): read again to be sure.
			s.log.Warn("config directory watch error; re-reading the configuration", "error", err)
			debounce.Reset(s.opts.Debounce)
		case <-debounce.C:
			s.changes.Notify()
		}
	}
}

// read runs read, the read of the source's files, between the watch's bookkeeping: the config
// directory watched again if it went away, the files being written noted before (a writer that
// finished during the read is one still), and the links followed to where they lead after it.
func (s *watched) read(read func() error) (writers, error) {
	var before writers
	s.mu.Lock()
	if s.w != nil {
		s.w.ensure() // the directory may be back after it went away
		before = s.w.writers()
	}
	s.mu.Unlock()
	err := read()
	s.mu.Lock()
	if s.w != nil {
		s.w.follow() // a ConfigMap update points the files at a new directory
	}
	s.mu.Unlock()
	return before, err
}

// whole returns nil when every file was read whole, else an error wrapping config.ErrUnsettled,
// with a read again set up for when they may be.
func (s *watched) whole(ws writers, files ...config.File) error {
	for _, file := range files {
		writing, lastWrite := ws.of(file.Path)
		if again, reason := s.unsettled(file, writing, lastWrite, time.Now()); again > 0 {
			s.log.Debug("the config file is being written; reading it again shortly", "path", file.Path,
				"reason", reason, "in", again)
			s.settle.Reset(again)
			return fmt.Errorf("config %s: %w: %s", file.Path, config.ErrUnsettled, reason)
		}
		if writing {
			s.log.Warn("the config file is still open for writing but unmodified for a while; reading it as it is",
				"path", file.Path, "lastWrite", lastWrite)
		}
	}
	s.settle.Stop()
	return nil
}

// unsettled tells whether a read of a config file may have caught it half-written, and if so
// when to read it again. A missing file is settled: a ConfigMap update or an editor replaces
// the file whole, by a rename.
func (s *watched) unsettled(file config.File, writing bool, lastWrite, now time.Time) (time.Duration, string) {
	if file.Missing {
		return 0, ""
	}
	if writing {
		if left := s.opts.WriterTimeout - now.Sub(lastWrite); left > 0 {
			// The close after the last write is an event that reads it sooner.
			return left, "a writer has it open"
		}
	}
	if file.Torn {
		return s.opts.Quiet, "it changed while it was read"
	}
	if file.Published {
		return 0, "" // a ConfigMap's files are complete before they appear
	}
	// An mtime in the future (a clock step, a copied timestamp) says nothing about writers.
	if age := now.Sub(file.ModTime); age >= 0 && age < s.opts.Quiet {
		return s.opts.Quiet - age, "it was modified " + age.Round(time.Millisecond).String() + " ago"
	}
	return 0, ""
}
