// Package vm boots a Debian kernel package in QEMU and runs a command inside it, on the host's
// root filesystem (read-only, through virtio-9p, with a tmpfs over it), so that the tests built
// on the host run on the kernels that production nodes run: the kernel matrix (test/kernels).
// The guest has no network device; the guest kernel's own modules are at /lib/modules, loaded
// on demand; the command's output and exit code come back, and a timeout ends the guest.
package vm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"golang.org/x/sys/unix"
)

// Kernel is a kernel of the matrix: a Debian kernel image package at a pinned version.
type Kernel struct {
	// Name is how KERNELS names it: the upstream series ("5.10").
	Name string
	// Suite is the Debian suite that serves the package.
	Suite string
	// Package and Version are the package pinned.
	Package, Version string
	// Runs says what production nodes run this series, for the docs and the logs.
	Runs string
}

// Matrix are the kernels the datapath is tested on besides the host's, oldest first: the oldest
// a fleet runs (5.10, Amazon Linux 2, the minimum), the LTS kernels of Debian, COS and Amazon
// Linux 2023 (6.1), and the one before this machine's (6.12). The versions are pinned so that
// a run is repeatable. Bullseye no longer moves, but bookworm's point releases and its
// backports replace their kernels: where the mirror no longer serves a pinned version, fetch
// says so, and the pin moves to the version the mirror has (apt-cache policy PACKAGE).
var Matrix = []Kernel{
	{Name: "5.10", Suite: "bullseye", Package: "linux-image-5.10.0-32-amd64", Version: "5.10.223-1",
		Runs: "Amazon Linux 2, Debian 11"},
	{Name: "6.1", Suite: "bookworm", Package: "linux-image-6.1.0-50-amd64", Version: "6.1.176-1",
		Runs: "Amazon Linux 2023, COS, Debian 12"},
	{Name: "6.12", Suite: "bookworm-backports", Package: "linux-image-6.12.95+deb12-amd64", Version: "6.12.95-1~bpo12+1",
		Runs: "Amazon Linux 2023, Debian 13"},
}

// Lookup returns the kernel of the matrix that name names.
func Lookup(name string) (Kernel, error) {
	var names []string
	for _, k := range Matrix {
		if k.Name == name {
			return k, nil
		}
		names = append(names, k.Name)
	}
	return Kernel{}, fmt.Errorf("no kernel %q in the matrix (%s)", name, strings.Join(names, ", "))
}

// dir is the kernel's directory in the cache: keyed by package and version.
func (k Kernel) dir(cache string) string {
	return filepath.Join(cache, k.Package+"_"+strings.NewReplacer("~", "_", ":", "_").Replace(k.Version))
}

// Image is a kernel unpacked in the cache, ready to boot.
type Image struct {
	Kernel
	// Root is the unpacked package; Vmlinuz its kernel, Release its `uname -r`, Modules its
	// /lib/modules/<release>.
	Root, Vmlinuz, Release, Modules string
	// Initramfs is the image that mounts the host's root and runs the command.
	Initramfs string
}

// fetchTimeout bounds the download and unpacking of one kernel (about 100 MB).
const fetchTimeout = 10 * time.Minute

// Prepare returns k's image from the cache (dir, made when missing), downloading, unpacking and
// preparing it first when it is not there. Several processes may prepare at once: they take
// turns on a lock in dir.
func Prepare(ctx context.Context, cache string, k Kernel) (*Image, error) {
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, err
	}
	unlock, err := lock(filepath.Join(cache, ".lock"), true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	dir := k.dir(cache)
	if _, err := os.Stat(filepath.Join(dir, ".ready")); err != nil {
		if err := fetch(ctx, cache, k, dir); err != nil {
			return nil, fmt.Errorf("kernel %s (%s %s): %w", k.Name, k.Package, k.Version, err)
		}
	}
	return open(dir, k)
}

// open reads an image unpacked in dir.
func open(dir string, k Kernel) (*Image, error) {
	img := &Image{Kernel: k, Root: dir, Initramfs: filepath.Join(dir, "initramfs.cpio")}
	vmlinuz, err := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	if err != nil || len(vmlinuz) != 1 {
		return nil, fmt.Errorf("kernel %s: want one boot/vmlinuz-* in %s, found %v", k.Name, dir, vmlinuz)
	}
	img.Vmlinuz = vmlinuz[0]
	img.Release = strings.TrimPrefix(filepath.Base(vmlinuz[0]), "vmlinuz-")
	img.Modules = filepath.Join(dir, "lib", "modules", img.Release)
	return img, nil
}

// fetch downloads k with apt-get (an APT configuration of its own, so the machine's is never
// changed), unpacks it into dir, indexes its modules and builds the initramfs, in a staging
// directory renamed into place: dir is whole or absent.
func fetch(ctx context.Context, cache string, k Kernel, dir string) error {
	staging := dir + ".staging"
	if err := os.RemoveAll(staging); err != nil {
		return err
	}
	defer os.RemoveAll(staging)
	aptDir := filepath.Join(cache, "apt")
	if err := aptUpdate(ctx, aptDir); err != nil {
		return err
	}
	debs := filepath.Join(staging, "debs")
	if err := os.MkdirAll(debs, 0o755); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "apt-get", append(aptOptions(aptDir), "download", k.Package+"="+k.Version)...)
	cmd.Dir = debs
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get download: %w: %s", err, testutil.LastLines(string(out), 10))
	}
	matches, err := filepath.Glob(filepath.Join(debs, "*.deb"))
	if err != nil || len(matches) != 1 {
		return fmt.Errorf("apt-get download left %v, want one package", matches)
	}
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", matches[0], staging).CombinedOutput(); err != nil {
		return fmt.Errorf("dpkg-deb -x: %w: %s", err, out)
	}
	if err := os.RemoveAll(debs); err != nil {
		return err
	}
	img, err := open(staging, k)
	if err != nil {
		return err
	}
	// The package leaves the module index to its postinst; modprobe in the guest needs it.
	if out, err := exec.CommandContext(ctx, "depmod", "-b", staging, img.Release).CombinedOutput(); err != nil {
		return fmt.Errorf("depmod: %w: %s", err, out)
	}
	if err := buildInitramfs(ctx, img); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(staging, ".ready"), nil, 0o644); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	return os.Rename(staging, dir)
}

// The suites the matrix's kernels come from, from the mirror the machine uses for Debian.
var suites = []string{"bullseye", "bookworm", "bookworm-backports"}

// debianKeyring verifies those suites' Release files (Debian's debian-archive-keyring, which
// test/deps.sh installs; on Ubuntu too).
const debianKeyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

func aptOptions(aptDir string) []string {
	return []string{
		"-q",
		"-o", "Dir::Etc::SourceList=" + filepath.Join(aptDir, "sources.list"),
		"-o", "Dir::Etc::SourceParts=/dev/null",
		"-o", "Dir::State=" + filepath.Join(aptDir, "state"),
		"-o", "Dir::Cache=" + filepath.Join(aptDir, "cache"),
		"-o", "Debug::NoLocking=1",
		"-o", "APT::Sandbox::User=root",
	}
}

// aptUpdate writes the APT configuration (the suites above, from the machine's Debian mirror)
// and reads the suites' package lists.
func aptUpdate(ctx context.Context, aptDir string) error {
	for _, d := range []string{"state/lists/partial", "cache/archives/partial"} {
		if err := os.MkdirAll(filepath.Join(aptDir, d), 0o755); err != nil {
			return err
		}
	}
	mirror := debianMirror()
	var b strings.Builder
	for _, s := range suites {
		fmt.Fprintf(&b, "deb [signed-by=%s] %s %s main\n", debianKeyring, mirror, s)
	}
	if err := os.WriteFile(filepath.Join(aptDir, "sources.list"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "apt-get", append(aptOptions(aptDir), "update")...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("apt-get update (%s): %w: %s", mirror, err, testutil.LastLines(string(out), 10))
	}
	return nil
}

// defaultMirror serves Debian where the machine names no Debian mirror of its own (Ubuntu).
const defaultMirror = "http://deb.debian.org/debian"

var mirrorLine = regexp.MustCompile(`^\s*(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+/debian)/?(?:\s|$)`)

// debianMirror is the mirror of the machine's Debian entries (sources.list, or deb822 .sources
// files), as the machine reaches Debian (a proxy or a local mirror where it must).
func debianMirror() string {
	files, _ := filepath.Glob("/etc/apt/sources.list.d/*")
	for _, f := range append([]string{"/etc/apt/sources.list"}, files...) {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			if m := mirrorLine.FindStringSubmatch(sc.Text()); m != nil {
				fh.Close()
				return m[1]
			}
		}
		fh.Close()
	}
	return defaultMirror
}

// lock takes an exclusive lock on path (flock), made where missing, waiting for it where wait
// is set, else failing at once where another holds it; the returned func releases it. A lock
// dies with its process, however it ends.
func lock(path string, wait bool) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	how := unix.LOCK_EX
	if !wait {
		how |= unix.LOCK_NB
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}
