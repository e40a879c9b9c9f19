"""scikit-learn pipeline -> ONNX, with the settings that keep onnxruntime equal to scikit-learn.

From ../shared/design/ONNX_NOTES.md: TF-IDF needs the converter options `locale: C.UTF-8` (else the
session fails to load) and an RE2 token pattern (else non-ASCII text is cut differently); `Log1p` and
`LogRidge` get small converters here so the graph itself outputs tokens; bytes are made reproducible
by a fixed graph name and a sorted opset list. A length line (`basin_pipeline.length_line`) is a graph of six
elementwise nodes built here by hand, with the same three inputs and output as a pipeline's graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper
from skl2onnx import convert_sklearn, update_registered_converter
from skl2onnx.algebra.onnx_ops import OnnxAdd, OnnxExp, OnnxLog, OnnxMatMul, OnnxSub
from skl2onnx.common.data_types import FloatTensorType, StringTensorType
from skl2onnx.common.shape_calculator import calculate_linear_regressor_output_shapes
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.pipeline import Pipeline

from basin_pipeline.features import LENGTH_INPUTS, RE2_TOKEN_PATTERN, TEXT_INPUT, Log1p, LogRidge
from basin_pipeline.length_line import LengthLine

OUTPUT_NAME = "peak_tokens"
GRAPH_NAME = "basin_peak_predictor"
TARGET_OPSET = 17


def _log1p_shape(operator: Any) -> None:
    operator.outputs[0].type = FloatTensorType(list(operator.inputs[0].type.shape))


def _log1p_converter(scope: Any, operator: Any, container: Any) -> None:
    opv = container.target_opset
    one = np.array([1.0], dtype=np.float32)
    node = OnnxLog(OnnxAdd(operator.inputs[0], one, op_version=opv), op_version=opv,
                   output_names=operator.outputs[:1])
    node.add_to(scope, container)


def _log_ridge_converter(scope: Any, operator: Any, container: Any) -> None:
    model: LogRidge = operator.raw_operator
    opv = container.target_opset
    coef = np.asarray(model.coef_, dtype=np.float32).reshape(-1, 1)
    intercept = np.array([model.intercept_], dtype=np.float32)
    linear = OnnxAdd(OnnxMatMul(operator.inputs[0], coef, op_version=opv), intercept, op_version=opv)
    node = OnnxSub(OnnxExp(linear, op_version=opv), np.array([1.0], dtype=np.float32), op_version=opv,
                   output_names=operator.outputs[:1])
    node.add_to(scope, container)


update_registered_converter(Log1p, "BasinLog1p", _log1p_shape, _log1p_converter)
update_registered_converter(LogRidge, "BasinLogRidge", calculate_linear_regressor_output_shapes,
                            _log_ridge_converter)


def to_onnx(model: Pipeline, metadata: Mapping[str, str]) -> ModelProto:
    """Convert a fitted predictor pipeline; the result's bytes depend only on the model and metadata."""
    initial_types = [(TEXT_INPUT, StringTensorType([None, 1]))]
    initial_types += [(name, FloatTensorType([None, 1])) for name in LENGTH_INPUTS]
    options = {TfidfVectorizer: {"tokenexp": RE2_TOKEN_PATTERN, "locale": "C.UTF-8"}}
    proto: ModelProto = convert_sklearn(
        model, initial_types=initial_types, final_types=[(OUTPUT_NAME, FloatTensorType([None, 1]))],
        options=options, target_opset=TARGET_OPSET, name=GRAPH_NAME,
    )
    ordered = sorted(proto.opset_import, key=lambda o: (o.domain, o.version))
    del proto.opset_import[:]
    proto.opset_import.extend(ordered)
    proto.producer_name, proto.producer_version, proto.doc_string = "basin", "1", ""
    proto.graph.doc_string = ""
    set_metadata(proto, metadata)
    onnx.checker.check_model(proto)
    return proto


def line_to_onnx(line: LengthLine, metadata: Mapping[str, str]) -> ModelProto:
    """A length line as ONNX: peak_tokens = exp(slope * log(1 + column) + intercept) - 1; the other inputs
    are declared (every predictor file takes the same three) and not read."""
    nodes = [
        helper.make_node("Add", [line.column, "one"], ["x1"]),
        helper.make_node("Log", ["x1"], ["log_x"]),
        helper.make_node("Mul", ["log_x", "slope"], ["slope_x"]),
        helper.make_node("Add", ["slope_x", "intercept"], ["z"]),
        helper.make_node("Exp", ["z"], ["e"]),
        helper.make_node("Sub", ["e", "one"], [OUTPUT_NAME]),
    ]
    initializers = [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
                    helper.make_tensor("slope", TensorProto.FLOAT, [], [line.slope]),
                    helper.make_tensor("intercept", TensorProto.FLOAT, [], [line.intercept])]
    inputs = [helper.make_tensor_value_info(TEXT_INPUT, TensorProto.STRING, [None, 1])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, 1]) for name in LENGTH_INPUTS]
    graph = helper.make_graph(nodes, GRAPH_NAME, inputs,
                              [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [None, 1])], initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", TARGET_OPSET)], producer_name="basin")
    proto.ir_version = 8
    proto.producer_version, proto.doc_string = "1", ""
    set_metadata(proto, metadata)
    onnx.checker.check_model(proto)
    return proto


def set_metadata(proto: ModelProto, metadata: Mapping[str, str]) -> None:
    """Replace the model's metadata with `metadata`, in key order (the graph is left as it is)."""
    del proto.metadata_props[:]
    for key in sorted(metadata):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, metadata[key]


def serialize(proto: ModelProto) -> bytes:
    """The model's bytes."""
    # protobuf ships no type information, so mypy sees `SerializeToString` as Any; bytes() states the
    # type and costs nothing (it returns the same object).
    return bytes(proto.SerializeToString())
