package vm

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

//go:embed init.sh
var initScript []byte

// bootModules are what the guest needs before it can reach the host's root: virtio-pci, 9p
// over virtio, overlayfs, and virtio-rng (so that getrandom does not wait on an idle guest).
// Debian builds them as modules (some are built in on newer kernels: skipped).
var bootModules = []string{"virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_rng"}

// busybox is the initramfs's shell and tools: Debian's busybox-static, which test/deps.sh
// installs.
const busybox = "/bin/busybox"

// buildInitramfs writes img.Initramfs: busybox, init.sh as /init, and bootModules with what
// they depend on, decompressed, in the order to load them (/modules.list).
func buildInitramfs(ctx context.Context, img *Image) error {
	tree, err := os.MkdirTemp(filepath.Dir(img.Root), "initramfs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tree)
	for _, d := range []string{"bin", "modules", "proc", "sys", "dev"} {
		if err := os.MkdirAll(filepath.Join(tree, d), 0o755); err != nil {
			return err
		}
	}
	bb, err := os.ReadFile(busybox)
	if err != nil {
		return fmt.Errorf("the initramfs needs a static busybox (apt-get install busybox-static): %w", err)
	}
	if err := os.WriteFile(filepath.Join(tree, "bin", "busybox"), bb, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tree, "init"), initScript, 0o755); err != nil {
		return err
	}
	order, err := moduleOrder(img.Modules, bootModules)
	if err != nil {
		return err
	}
	var list strings.Builder
	for _, rel := range order {
		name, err := unpackModule(ctx, filepath.Join(img.Modules, rel), filepath.Join(tree, "modules"))
		if err != nil {
			return err
		}
		list.WriteString(name + "\n")
	}
	if err := os.WriteFile(filepath.Join(tree, "modules.list"), []byte(list.String()), 0o644); err != nil {
		return err
	}
	return writeCpio(ctx, tree, img.Initramfs)
}

// moduleOrder returns the module files (relative to the modules directory) that load want, each
// after those it depends on, from the index depmod wrote (modules.dep). Modules built into the
// kernel (modules.builtin) are left out; one that is neither is an error.
func moduleOrder(modules string, want []string) ([]string, error) {
	deps, err := readModulesDep(filepath.Join(modules, "modules.dep"))
	if err != nil {
		return nil, err
	}
	builtin, err := os.ReadFile(filepath.Join(modules, "modules.builtin"))
	if err != nil {
		return nil, err
	}
	byName := map[string]string{}
	for file := range deps {
		byName[moduleName(file)] = file
	}
	isBuiltin := map[string]bool{}
	for _, line := range strings.Fields(string(builtin)) {
		isBuiltin[moduleName(line)] = true
	}
	var order []string
	seen := map[string]bool{}
	var add func(file string)
	add = func(file string) {
		if seen[file] {
			return
		}
		seen[file] = true
		for _, d := range deps[file] {
			add(d)
		}
		order = append(order, file)
	}
	for _, name := range want {
		file, ok := byName[name]
		switch {
		case ok:
			add(file)
		case !isBuiltin[name]:
			return nil, fmt.Errorf("module %s: neither in modules.dep nor built in", name)
		}
	}
	return order, nil
}

// readModulesDep reads depmod's modules.dep: "file: dependency ...".
func readModulesDep(path string) (map[string][]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	deps := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		file, rest, ok := strings.Cut(sc.Text(), ":")
		if ok {
			deps[file] = strings.Fields(rest)
		}
	}
	return deps, sc.Err()
}

// moduleName is the name of a module file as modprobe knows it (kernel/fs/9p/9p.ko.xz: 9p).
func moduleName(file string) string {
	base := filepath.Base(file)
	base, _, _ = strings.Cut(base, ".ko")
	return strings.ReplaceAll(base, "-", "_")
}

// unpackModule copies a module into dir, decompressed (busybox's insmod takes plain ELF), and
// returns its file name there.
func unpackModule(ctx context.Context, src, dir string) (string, error) {
	name := moduleName(src) + ".ko"
	var out []byte
	var err error
	switch {
	case strings.HasSuffix(src, ".xz"):
		out, err = exec.CommandContext(ctx, "xz", "-dc", src).Output()
	case strings.HasSuffix(src, ".zst"):
		out, err = exec.CommandContext(ctx, "zstd", "-dcq", src).Output()
	case strings.HasSuffix(src, ".gz"):
		out, err = exec.CommandContext(ctx, "gzip", "-dc", src).Output()
	default:
		out, err = os.ReadFile(src)
	}
	if err != nil {
		return "", fmt.Errorf("decompress %s: %w", src, err)
	}
	return name, os.WriteFile(filepath.Join(dir, name), out, 0o644)
}

// writeCpio archives tree as an initramfs (newc) at path.
func writeCpio(ctx context.Context, tree, path string) error {
	var files bytes.Buffer
	err := filepath.WalkDir(tree, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(tree, p)
		if err == nil {
			files.WriteString(rel + "\n")
		}
		return err
	})
	if err != nil {
		return err
	}
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	defer out.Close()
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "cpio", "--quiet", "-o", "-H", "newc", "--owner", "0:0")
	cmd.Dir, cmd.Stdin, cmd.Stdout, cmd.Stderr = tree, &files, out, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("cpio: %w: %s", err, stderr.String())
	}
	return out.Close()
}
