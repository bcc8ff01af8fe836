package config

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultPath is where the upstream DaemonSet mounts the ConfigMap.
const DefaultPath = "/etc/config/ip-masq-agent"

// MaxFileSize bounds how much of a config file is read. 100k CIDRs fit in well under this.
const MaxFileSize = 16 << 20

// Load reads the configuration at path: a file, or a directory whose files matching
// opts.Pattern are merged (see IsDir and Dir.Parse). A missing file means the defaults; so does
// an empty one.
func Load(path string, opts Options) (Config, error) {
	if IsDir(path) {
		d, err := ReadDir(path, opts.FilePattern())
		if err != nil {
			return Config{}, err
		}
		return d.Parse(opts)
	}
	f, err := ReadFile(path)
	if err != nil {
		return Config{}, err
	}
	return f.Parse(opts)
}

// File is one read of a configuration file.
type File struct {
	Path string
	Data []byte
	// Missing is true when there is no file at Path (nor at the end of its symlinks): the
	// defaults apply.
	Missing bool
	// ModTime is the file's modification time as the read ended.
	ModTime time.Time
	// Torn is true when the file changed while it was read (its size or modification time
	// differ before and after), so Data may mix two versions.
	Torn bool
	// Published is true when the path leads, through symlinks, into a directory the way the
	// kubelet publishes a ConfigMap: its files are written whole into a new "..<timestamp>"
	// directory before the "..data" link is swapped to it, and never modified there, so the
	// file cannot be half-written.
	Published bool
}

// publishedDir matches the kubelet's ConfigMap payload directories ("..2026_01_01_00_00_00.123").
var publishedDir = regexp.MustCompile(`^\.\.\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2}\.\d+$`)

// ReadFile reads the file at path, following symlinks (a ConfigMap mount is symlinks through
// "..data"). Only a regular file of at most MaxFileSize bytes is read: a FIFO would block the
// reader, a device could be endless.
func ReadFile(path string) (File, error) {
	out := File{Path: path}
	// O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		out.Missing = true
		return out, nil
	}
	if err != nil {
		return out, fmt.Errorf("open config %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	before, err := f.Stat()
	if err != nil {
		return out, fmt.Errorf("stat config %s: %w", path, err)
	}
	if !before.Mode().IsRegular() {
		return out, fmt.Errorf("config %s is not a regular file but a %s", path, fileType(before.Mode()))
	}
	if before.Size() > MaxFileSize {
		return out, tooLarge(path, before.Size())
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return out, fmt.Errorf("read config %s: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return out, tooLarge(path, int64(len(data)))
	}
	after, err := f.Stat()
	if err != nil {
		return out, fmt.Errorf("stat config %s: %w", path, err)
	}
	out.Data, out.ModTime = data, after.ModTime()
	if real, err := filepath.EvalSymlinks(path); err == nil && real != filepath.Clean(path) {
		out.Published = publishedDir.MatchString(filepath.Base(filepath.Dir(real)))
	}
	out.Torn = before.Size() != after.Size() || !before.ModTime().Equal(after.ModTime()) ||
		int64(len(data)) != after.Size()
	return out, nil
}

func tooLarge(path string, size int64) error {
	return fmt.Errorf("config %s is larger than the limit of %d bytes (%d MiB): %d bytes", path,
		MaxFileSize, MaxFileSize>>20, size)
}

func fileType(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeCharDevice != 0:
		return "character device"
	case m&os.ModeDevice != 0:
		return "device"
	}
	return m.Type().String()
}

// Parse parses the file's data (see Parse); a missing file gives the defaults.
func (f File) Parse(opts Options) (Config, error) {
	if f.Missing {
		return Default(opts), nil
	}
	cfg, err := Parse(f.Data, opts)
	if err != nil {
		return Config{}, fmt.Errorf("config %s: %w", f.Path, err)
	}
	return cfg, nil
}
