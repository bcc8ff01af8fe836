package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

// readTar returns a tar's headers and the contents of its regular files, by name.
func readTar(t *testing.T, r io.Reader) ([]*tar.Header, map[string][]byte) {
	t.Helper()
	var headers []*tar.Header
	data := map[string][]byte{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return headers, data
		}
		if err != nil {
			t.Fatal(err)
		}
		headers = append(headers, h)
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			data[h.Name] = b
		}
	}
}

func readTarFile(t *testing.T, name string) ([]*tar.Header, map[string][]byte) {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return readTar(t, f)
}

// WriteLayer writes files, directories and links where the entries say, owned by root and
// stamped with the epoch, and refuses what would not be an image path.
func TestWriteLayer(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "tool")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	epoch := time.Unix(1700000000, 0)
	layer := filepath.Join(dir, "layer.tar")
	entries := []Entry{
		{Path: "/tool", Source: bin, Mode: 0o755},
		{Path: "/tool-2", Link: "tool"},
		{Path: "/uploads"},
		{Path: "/uploads/key", Source: bin},
	}
	if err := WriteLayer(layer, epoch, entries); err != nil {
		t.Fatal(err)
	}
	headers, data := readTarFile(t, layer)
	type entry struct {
		name     string
		typ      byte
		mode     int64
		linkname string
	}
	var got []entry
	for _, h := range headers {
		got = append(got, entry{h.Name, h.Typeflag, h.Mode, h.Linkname})
		if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(epoch) {
			t.Errorf("%s: owner %d:%d, time %v; want 0:0, %v", h.Name, h.Uid, h.Gid, h.ModTime, epoch)
		}
	}
	want := []entry{
		{"tool", tar.TypeReg, 0o755, ""},
		{"tool-2", tar.TypeSymlink, 0o777, "tool"},
		{"uploads/", tar.TypeDir, 0o755, ""},
		{"uploads/key", tar.TypeReg, 0o644, ""},
	}
	if !slices.Equal(got, want) {
		t.Errorf("entries:\n %v\nwant\n %v", got, want)
	}
	if string(data["tool"]) != "#!/bin/sh\n" {
		t.Errorf("tool holds %q", data["tool"])
	}

	for _, bad := range []Entry{
		{Path: "relative", Source: bin},
		{Path: "/a/../b", Source: bin},
		{Path: "/"},
		{Path: "/both", Source: bin, Link: "x"},
		{Path: "/dir", Source: dir},
		{Path: "/missing", Source: filepath.Join(dir, "missing")},
	} {
		if err := WriteLayer(filepath.Join(dir, "bad.tar"), epoch, []Entry{bad}); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

// Pack with several layers: the manifest lists them in order, the configuration's diff IDs
// match, each blob is the layer's bytes (one blob for a layer given twice), and Cmd and an empty
// Binary become the configuration's Cmd and no entrypoint.
func TestPackLayers(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "f")
	if err := os.WriteFile(src, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	epoch := time.Unix(0, 0)
	base, top := filepath.Join(dir, "base.tar"), filepath.Join(dir, "top.tar")
	if err := WriteLayer(base, epoch, []Entry{{Path: "/etc"}, {Path: "/etc/f", Source: src}}); err != nil {
		t.Fatal(err)
	}
	if err := WriteLayer(top, epoch, []Entry{{Path: "/f-link", Link: "etc/f"}}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name       string
		spec       Spec
		layers     []string
		entrypoint []string
		cmd        []string
	}{
		{"entrypoint and cmd", Spec{Binary: "/agnhost", Cmd: []string{"pause"}}, []string{base, top}, []string{"/agnhost"}, []string{"pause"}},
		{"cmd only", Spec{Cmd: []string{"sh"}}, []string{base, top, base}, nil, []string{"sh"}},
		{"entrypoint only", Spec{Binary: "/pause"}, []string{top}, []string{"/pause"}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(dir, "image.tar")
			const ref = "registry.example/test:1"
			res, err := Pack(Options{Spec: c.spec, Reference: ref, Epoch: epoch, Output: out}, c.layers...)
			if err != nil {
				t.Fatal(err)
			}
			_, files := readTarFile(t, out)
			var index v1.Index
			mustUnmarshal(t, files["index.json"], &index)
			if len(index.Manifests) != 1 || index.Manifests[0].Annotations[v1.AnnotationRefName] != ref ||
				index.Manifests[0].Annotations["io.containerd.image.name"] != ref || index.Manifests[0].Digest != res.Manifest {
				t.Fatalf("index: %+v", index)
			}
			var manifest v1.Manifest
			mustUnmarshal(t, files[blobPath(res.Manifest)], &manifest)
			var image v1.Image
			mustUnmarshal(t, files[blobPath(manifest.Config.Digest)], &image)
			if manifest.Config.Digest != res.Config {
				t.Errorf("config %s, result %s", manifest.Config.Digest, res.Config)
			}
			var size int64
			var layers, diffIDs []digest.Digest
			for i, l := range c.layers {
				b, err := os.ReadFile(l)
				if err != nil {
					t.Fatal(err)
				}
				d := digest.FromBytes(b)
				layers, size = append(layers, d), size+int64(len(b))
				if !bytes.Equal(files[blobPath(d)], b) {
					t.Errorf("layer %d: the blob is not the tar", i)
				}
				if i >= len(manifest.Layers) || manifest.Layers[i].Digest != d || manifest.Layers[i].Size != int64(len(b)) {
					t.Errorf("layer %d: manifest %+v, want %s", i, manifest.Layers, d)
				}
			}
			diffIDs = image.RootFS.DiffIDs
			if !slices.Equal(diffIDs, layers) || len(image.History) != len(layers) || len(manifest.Layers) != len(layers) {
				t.Errorf("diff IDs %v, %d history entries, %d manifest layers; want %v", diffIDs, len(image.History), len(manifest.Layers), layers)
			}
			if !slices.Equal(image.Config.Entrypoint, c.entrypoint) || !slices.Equal(image.Config.Cmd, c.cmd) {
				t.Errorf("entrypoint %q cmd %q, want %q %q", image.Config.Entrypoint, image.Config.Cmd, c.entrypoint, c.cmd)
			}
			if res.LayerSize != size {
				t.Errorf("layer size %d, want %d", res.LayerSize, size)
			}
		})
	}
	if _, err := Pack(Options{Output: filepath.Join(dir, "none.tar")}); err == nil {
		t.Error("Pack without a layer: no error")
	}
}

func mustUnmarshal(t *testing.T, data []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", data, err)
	}
}

// Retag names the same image anew: every file but the index is copied as it is, and the index
// names the same manifest under the new reference.
func TestRetag(t *testing.T) {
	dir := t.TempDir()
	layer := filepath.Join(dir, "layer.tar")
	if err := WriteLayer(layer, time.Unix(0, 0), []Entry{{Path: "/d"}}); err != nil {
		t.Fatal(err)
	}
	src, dst := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	res, err := Pack(Options{Spec: Spec{Binary: "/pause"}, Reference: "registry.example/pause:1", Output: src}, layer)
	if err != nil {
		t.Fatal(err)
	}
	const ref = "registry.example/pause:1.1"
	if err := Retag(src, dst, ref); err != nil {
		t.Fatal(err)
	}
	before, a := readTarFile(t, src)
	after, b := readTarFile(t, dst)
	if len(before) != len(after) {
		t.Fatalf("%d entries, then %d", len(before), len(after))
	}
	for name, data := range a {
		if name != "index.json" && !bytes.Equal(data, b[name]) {
			t.Errorf("%s changed", name)
		}
	}
	var index v1.Index
	mustUnmarshal(t, b["index.json"], &index)
	if len(index.Manifests) != 1 || index.Manifests[0].Digest != res.Manifest ||
		index.Manifests[0].Annotations[v1.AnnotationRefName] != ref || index.Manifests[0].Annotations["io.containerd.image.name"] != ref {
		t.Errorf("index: %+v", index)
	}
	if err := Retag(layer, filepath.Join(dir, "c.tar"), ref); err == nil {
		t.Error("Retag of a tar without an index: no error")
	}
}
